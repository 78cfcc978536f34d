//! A decoder's steps, written once: which norms a layer applies and where
//! ([`NormPlacement`]), whether attention and MLP run side by side, and which multipliers and
//! softcaps apply, derived from a [`ModelConfig`] by [`Decoder::of`] and run through
//! [`DecoderOps`]. The CPU model ([`super::Model`]), the resident model
//! ([`super::resident::ResidentModel`]) and the candle model implement the operations; what a
//! sublayer does inside (projections, q/k norms, RoPE, the attention kernel, experts) is theirs.

use super::config::{ModelConfig, NormPlacement};

/// Where a norm sits in the decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormAt {
    /// After the embedding (bloom's `word_embeddings_layernorm`).
    Embedding,
    /// A layer's norm.
    Layer(usize, LayerNorm),
    /// Before the LM head.
    Final,
}

/// A layer's norms, in [`NormPlacement::norm_names`]' order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerNorm {
    /// Before attention (`input_layernorm`).
    BeforeAttention,
    /// On attention's output, before the residual add.
    AfterAttention,
    /// Before the MLP.
    BeforeMlp,
    /// On the MLP's output, before the residual add.
    AfterMlp,
}

/// A constant multiplier of the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Multiplier {
    /// On the embeddings (`ModelConfig::embed_multiplier`).
    Embedding,
    /// On each sublayer's output before the residual add (`residual_multiplier`).
    Residual,
    /// On the logits (`logit_multiplier`).
    Logits,
}

/// The operations a decoder runs on, over rows of activations (the residual stream, a
/// sublayer's input or output): a model implements them once per place it runs.
pub trait DecoderOps {
    /// Rows of activations, `[tokens, width]`. A clone is another handle to the same values
    /// or a copy of them: the steps never write through one handle and read another.
    type Rows: Clone;
    /// What an operation fails with.
    type Error;
    /// The tokens' embeddings.
    fn embed(&mut self) -> Result<Self::Rows, Self::Error>;
    /// The norm at `at` over `x`; called only where the config has that norm.
    fn norm(&mut self, at: NormAt, x: &Self::Rows) -> Result<Self::Rows, Self::Error>;
    /// Layer `layer`'s attention over its normed input.
    fn attention(&mut self, layer: usize, h: &Self::Rows) -> Result<Self::Rows, Self::Error>;
    /// Layer `layer`'s MLP (dense or experts) over its normed input.
    fn mlp(&mut self, layer: usize, h: &Self::Rows) -> Result<Self::Rows, Self::Error>;
    /// `x + y` (in `x`'s storage where the rows own one).
    fn add(&mut self, x: Self::Rows, y: &Self::Rows) -> Result<Self::Rows, Self::Error>;
    /// `x` times the config's multiplier `by`; called only where the config has it.
    fn scale(&mut self, x: Self::Rows, by: Multiplier) -> Result<Self::Rows, Self::Error>;
    /// The logits of the final hidden rows (the LM head, or the tied embedding).
    fn head(&mut self, x: &Self::Rows) -> Result<Self::Rows, Self::Error>;
    /// `c * tanh(logits / c)` for the config's final softcap `c`; called only where it has one.
    fn softcap(&mut self, logits: Self::Rows) -> Result<Self::Rows, Self::Error>;
}

/// The steps of a model's decoder, derived from its config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decoder {
    layers: usize,
    placement: NormPlacement,
    embed_norm: bool,
    multipliers: [bool; 3],
    final_softcap: bool,
}

impl Decoder {
    /// The steps of `config`'s decoder.
    pub fn of(config: &ModelConfig) -> Decoder {
        Decoder {
            layers: config.layers,
            placement: config.placement,
            embed_norm: config.embed_norm,
            multipliers: [
                config.embed_multiplier.is_some(),
                config.residual_multiplier.is_some(),
                config.logit_multiplier.is_some(),
            ],
            final_softcap: config.final_softcap.is_some(),
        }
    }

    /// The logits of the decoder run on `ops`: embedding, each layer, final norm, head.
    pub fn run<O: DecoderOps>(&self, ops: &mut O) -> Result<O::Rows, O::Error> {
        let mut x = ops.embed()?;
        x = self.scaled(ops, x, Multiplier::Embedding)?;
        if self.embed_norm {
            x = ops.norm(NormAt::Embedding, &x)?;
        }
        for layer in 0..self.layers {
            x = self.layer(ops, layer, x)?;
        }
        let x = ops.norm(NormAt::Final, &x)?;
        let logits = ops.head(&x)?;
        let logits = self.scaled(ops, logits, Multiplier::Logits)?;
        match self.final_softcap {
            true => ops.softcap(logits),
            false => Ok(logits),
        }
    }

    /// One layer over the stream `x`.
    fn layer<O: DecoderOps>(&self, ops: &mut O, i: usize, x: O::Rows) -> Result<O::Rows, O::Error> {
        use LayerNorm::*;
        // Without a norm before it, a sublayer reads the stream itself.
        let h = self.normed(ops, i, BeforeAttention, &x)?;
        let a = ops.attention(i, &h)?;
        if self.placement.parallel() {
            // Both sublayers read the stream (normed once, or each by its own norm) and add
            // to it together.
            let h = match self.has(BeforeMlp) {
                true => ops.norm(NormAt::Layer(i, BeforeMlp), &x)?,
                false => h,
            };
            let m = ops.mlp(i, &h)?;
            let both = ops.add(a, &m)?;
            return ops.add(x, &both);
        }
        let a = self.normed(ops, i, AfterAttention, &a)?;
        let a = self.scaled(ops, a, Multiplier::Residual)?;
        let x = ops.add(x, &a)?;
        let h = self.normed(ops, i, BeforeMlp, &x)?;
        let m = ops.mlp(i, &h)?;
        let m = self.normed(ops, i, AfterMlp, &m)?;
        let m = self.scaled(ops, m, Multiplier::Residual)?;
        ops.add(x, &m)
    }

    /// Whether a layer has the norm `at` under the config's placement.
    pub fn has(&self, at: LayerNorm) -> bool {
        self.placement.norm_names()[at as usize].is_some()
    }

    fn normed<O: DecoderOps>(
        &self,
        ops: &mut O,
        i: usize,
        at: LayerNorm,
        x: &O::Rows,
    ) -> Result<O::Rows, O::Error> {
        match self.has(at) {
            true => ops.norm(NormAt::Layer(i, at), x),
            false => Ok(x.clone()),
        }
    }

    fn scaled<O: DecoderOps>(
        &self,
        ops: &mut O,
        x: O::Rows,
        by: Multiplier,
    ) -> Result<O::Rows, O::Error> {
        match self.multipliers[by as usize] {
            true => ops.scale(x, by),
            false => Ok(x),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows as the text of what was computed, to read the steps back.
    struct Trace;

    impl DecoderOps for Trace {
        type Rows = String;
        type Error = ();
        fn embed(&mut self) -> Result<String, ()> {
            Ok("e".into())
        }
        fn norm(&mut self, at: NormAt, x: &String) -> Result<String, ()> {
            Ok(match at {
                NormAt::Embedding => format!("ne({x})"),
                NormAt::Final => format!("nf({x})"),
                NormAt::Layer(_, at) => format!("n{}({x})", at as usize),
            })
        }
        fn attention(&mut self, i: usize, h: &String) -> Result<String, ()> {
            Ok(format!("a{i}({h})"))
        }
        fn mlp(&mut self, i: usize, h: &String) -> Result<String, ()> {
            Ok(format!("m{i}({h})"))
        }
        fn add(&mut self, x: String, y: &String) -> Result<String, ()> {
            Ok(format!("{x}+{y}"))
        }
        fn scale(&mut self, x: String, by: Multiplier) -> Result<String, ()> {
            Ok(format!("s{}[{x}]", by as usize))
        }
        fn head(&mut self, x: &String) -> Result<String, ()> {
            Ok(format!("h({x})"))
        }
        fn softcap(&mut self, x: String) -> Result<String, ()> {
            Ok(format!("c({x})"))
        }
    }

    fn steps(placement: NormPlacement, change: impl Fn(&mut Decoder)) -> String {
        let mut decoder = Decoder {
            layers: 1,
            placement,
            embed_norm: false,
            multipliers: [false; 3],
            final_softcap: false,
        };
        change(&mut decoder);
        decoder.run(&mut Trace).unwrap()
    }

    #[test]
    fn each_placement_puts_its_norms_where_hugging_face_does() {
        let none = |_: &mut Decoder| {};
        assert_eq!(
            steps(NormPlacement::Pre, none),
            "h(nf(e+a0(n0(e))+m0(n2(e+a0(n0(e))))))"
        );
        assert_eq!(
            steps(NormPlacement::Post, none),
            "h(nf(e+n1(a0(e))+n3(m0(e+n1(a0(e))))))"
        );
        assert_eq!(
            steps(NormPlacement::Sandwich, none),
            "h(nf(e+n1(a0(n0(e)))+n3(m0(n2(e+n1(a0(n0(e))))))))"
        );
        assert_eq!(
            steps(NormPlacement::Parallel, none),
            "h(nf(e+a0(n0(e))+m0(n0(e))))"
        );
        assert_eq!(
            steps(NormPlacement::ParallelTwoNorms, none),
            "h(nf(e+a0(n0(e))+m0(n2(e))))"
        );
    }

    #[test]
    fn multipliers_embedding_norms_and_softcaps_apply_where_configured() {
        let all = |d: &mut Decoder| {
            d.embed_norm = true;
            d.multipliers = [true; 3];
            d.final_softcap = true;
        };
        assert_eq!(
            steps(NormPlacement::Pre, all),
            "c(s2[h(nf(ne(s0[e])+s1[a0(n0(ne(s0[e])))]+s1[m0(n2(ne(s0[e])+s1[a0(n0(ne(s0[e])))]))]))])"
        );
        // Side by side, the residual multiplier is not applied (cohere has none).
        assert_eq!(
            steps(NormPlacement::Parallel, all),
            "c(s2[h(nf(ne(s0[e])+a0(n0(ne(s0[e])))+m0(n0(ne(s0[e])))))])"
        );
    }
}
