//! Printing a spec in the spec language, normalized: fixed key order, derived defaults shown,
//! so that `parse(print(spec)) == spec`.

use crate::spec::{
    AttentionSpec, CausalAlign, DataDim, KvLayout, Mask, Normalize, ParamDim, Position, Rope,
    RopeLayout, RopeScaling, Sinks,
};
use std::fmt;

/// Floats print in Rust's shortest round-trip form, always with a `.` or an exponent, so they
/// read back as floats.
struct F(f64);

impl fmt::Display for F {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl fmt::Display for AttentionSpec {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "heads = {}", self.heads)?;
        match self.kv {
            KvLayout::Heads { kv_heads } => write!(f, ", kv_heads = {kv_heads}")?,
            KvLayout::Mla(mla) => write!(
                f,
                ", mla(latent_rank = {}, rope_dim = {})",
                mla.latent_rank, mla.rope_dim
            )?,
        }
        write!(
            f,
            ", head_dim = {}, v_head_dim = {}, mask = {}, position = {}",
            self.head_dim, self.v_head_dim, self.mask, self.position
        )?;
        if let Some(c) = self.softcap {
            write!(f, ", softcap = {}", F(c))?;
        }
        if let Some(s) = self.scale {
            write!(f, ", scale = {}", F(s))?;
        }
        write!(f, ", dtype = {}", self.dtype.name())?;
        if self.sinks == Sinks::Learned {
            write!(f, ", sinks = learned")?;
        }
        if self.normalize != Normalize::Softmax {
            write!(f, ", normalize = {}", self.normalize.name())?;
        }
        if let Some(d) = self.differential {
            write!(f, ", differential = lambda(init = {})", F(d.lambda_init))?;
        }
        if !self.params.is_empty() {
            write!(f, ", params(")?;
            for (i, p) in self.params.iter().enumerate() {
                let dims: Vec<String> = p
                    .dims
                    .iter()
                    .map(|d| match d {
                        ParamDim::Fixed(n) => n.to_string(),
                        ParamDim::Heads => "heads".to_string(),
                        ParamDim::KvHeads => "kv_heads".to_string(),
                    })
                    .collect();
                let sep = if i == 0 { "" } else { ", " };
                write!(f, "{sep}{}: [{}]", p.name, dims.join(", "))?;
                if !p.init.is_default() {
                    write!(f, " = {}", p.init)?;
                }
            }
            write!(f, ")")?;
        }
        if !self.data.is_empty() {
            write!(f, ", data(")?;
            for (i, d) in self.data.iter().enumerate() {
                let dims: Vec<String> = d
                    .dims
                    .iter()
                    .map(|d| match d {
                        DataDim::Fixed(n) => n.to_string(),
                        DataDim::Heads => "heads".to_string(),
                        DataDim::KvHeads => "kv_heads".to_string(),
                        DataDim::Batch => "batch".to_string(),
                        DataDim::Seq => "seq".to_string(),
                    })
                    .collect();
                let sep = if i == 0 { "" } else { ", " };
                write!(
                    f,
                    "{sep}{}: [{}] {}",
                    d.name,
                    dims.join(", "),
                    d.dtype.name()
                )?;
            }
            write!(f, ")")?;
        }
        if let Some(m) = &self.score_mod {
            write!(f, ", score_mod = {m}")?;
        }
        if let Some(m) = &self.mask_mod {
            write!(f, ", mask_mod = {m}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Mask {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Mask::None => write!(f, "none"),
            Mask::Causal(CausalAlign::BottomRight) => write!(f, "causal"),
            Mask::Causal(CausalAlign::TopLeft) => write!(f, "causal(top_left)"),
            Mask::SlidingWindow { window } => write!(f, "sliding_window({window})"),
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Position::None => write!(f, "none"),
            Position::Alibi => write!(f, "alibi"),
            Position::Rope(rope) => write!(f, "{rope}"),
        }
    }
}

impl fmt::Display for Rope {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        let layout = match self.layout {
            RopeLayout::Half => "half",
            RopeLayout::Interleaved => "interleaved",
        };
        let name = if self.xpos.is_some() { "xpos" } else { "rope" };
        write!(
            f,
            "{name}(base = {}, dim = {}, layout = {layout}",
            F(self.base),
            self.dim
        )?;
        if self.scaling != RopeScaling::None {
            write!(f, ", scaling = {}", self.scaling)?;
        }
        if let Some(x) = self.xpos {
            write!(
                f,
                ", scale_base = {}, gamma = {}",
                F(x.scale_base),
                F(x.gamma)
            )?;
        }
        write!(f, ")")
    }
}

impl fmt::Display for RopeScaling {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match *self {
            RopeScaling::None => write!(f, "none"),
            RopeScaling::Linear { factor } => write!(f, "linear(factor = {})", F(factor)),
            RopeScaling::Ntk { factor } => write!(f, "ntk(factor = {})", F(factor)),
            RopeScaling::Dynamic {
                factor,
                original_max_position,
            } => write!(
                f,
                "dynamic(factor = {}, original_max_position = {original_max_position})",
                F(factor)
            ),
            RopeScaling::Yarn(y) => {
                write!(
                    f,
                    "yarn(factor = {}, original_max_position = {}, beta_fast = {}, beta_slow = {}",
                    F(y.factor),
                    y.original_max_position,
                    F(y.beta_fast),
                    F(y.beta_slow)
                )?;
                if let Some(m) = y.mscale {
                    write!(f, ", mscale = {}", F(m))?;
                }
                if let Some(m) = y.mscale_all_dim {
                    write!(f, ", mscale_all_dim = {}", F(m))?;
                }
                if !y.truncate {
                    write!(f, ", truncate = false")?;
                }
                write!(f, ")")
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => write!(
                f,
                "llama3(factor = {}, low_freq_factor = {}, high_freq_factor = {}, \
                 original_max_position = {original_max_position})",
                F(factor),
                F(low_freq_factor),
                F(high_freq_factor)
            ),
            RopeScaling::LongRope(ref l) => {
                let list = |v: &[f64]| {
                    let items: Vec<String> = v.iter().map(|x| F(*x).to_string()).collect();
                    items.join(", ")
                };
                write!(
                    f,
                    "longrope(short = [{}], long = [{}], original_max_position = {}, \
                     attention_factor = {})",
                    list(&l.short),
                    list(&l.long),
                    l.original_max_position,
                    F(l.attention_factor)
                )
            }
        }
    }
}
