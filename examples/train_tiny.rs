//! A small character-level transformer trained with candle, its attention declared with
//! `#[attention]` and run by attn's kernels (forward and backward):
//!
//! ```sh
//! cargo run --release --features candle --example train_tiny -- README.md
//! ```
//!
//! Pre-norm blocks (RMSNorm, RoPE attention, SwiGLU), tied input and output embeddings, AdamW.
//! It trains on random windows of the text file, prints the loss under a progress bar, and
//! ends by comparing the held-out loss with a unigram model's (the entropy of the text's
//! characters): exit code 0 when the model beats it, 1 when it does not, 2 on bad input.

use attn::candle::CandleAttention;
use attn::candle::core::{DType, Device, Module, Result, Tensor, Var};
use attn::candle::nn::{
    AdamW, Embedding, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap, embedding,
    linear_no_bias, loss, ops,
};
use attn::inputs::XorShift;
use attn::{Attention, attention};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::process::ExitCode;

/// The model's attention: 4 heads of 16 dims, causal, RoPE inside the kernel.
#[attention(heads = 4, head_dim = 16, mask = causal, position = rope)]
struct CharAttention;

const HEADS: usize = CharAttention::HEADS as usize;
const HEAD_DIM: usize = CharAttention::HEAD_DIM as usize;
const MODEL: usize = HEADS * HEAD_DIM;
const LAYERS: usize = 2;
const CONTEXT: usize = 64;
const BATCH: usize = 16;
const STEPS: usize = 300;
/// Texts are read whole; this keeps a mistaken path (a disk image, say) from filling memory.
const MAX_TEXT_BYTES: u64 = 64 << 20;

/// RMSNorm written with candle's ops, which carry gradients.
struct RmsNorm(Tensor);

impl RmsNorm {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(RmsNorm(vb.get_with_hints(
            MODEL,
            "weight",
            attn::candle::nn::Init::Const(1.0),
        )?))
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::rms_norm_slow(x, &self.0, 1e-5)
    }
}

/// A pre-norm block: `x + attention(norm(x))`, then `x + swiglu(norm(x))`.
struct Block {
    attention_norm: RmsNorm,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    mlp_norm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Block {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Block {
            attention_norm: RmsNorm::new(vb.pp("attention_norm"))?,
            wq: linear_no_bias(MODEL, MODEL, vb.pp("wq"))?,
            wk: linear_no_bias(MODEL, MODEL, vb.pp("wk"))?,
            wv: linear_no_bias(MODEL, MODEL, vb.pp("wv"))?,
            wo: linear_no_bias(MODEL, MODEL, vb.pp("wo"))?,
            mlp_norm: RmsNorm::new(vb.pp("mlp_norm"))?,
            gate: linear_no_bias(MODEL, 4 * MODEL, vb.pp("gate"))?,
            up: linear_no_bias(MODEL, 4 * MODEL, vb.pp("up"))?,
            down: linear_no_bias(4 * MODEL, MODEL, vb.pp("down"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let h = self.attention_norm.forward(x)?;
        // [B, S, H * D] as [B, H, S, D]: a strided view, which attn reads as it is.
        let heads = |t: Tensor| t.reshape((b, s, HEADS, HEAD_DIM))?.transpose(1, 2);
        let q = heads(self.wq.forward(&h)?)?;
        let k = heads(self.wk.forward(&h)?)?;
        let v = heads(self.wv.forward(&h)?)?;
        let a = CharAttention::candle_forward(&q, &k, &v)?;
        let a = a.transpose(1, 2)?.reshape((b, s, MODEL))?;
        let x = (x + self.wo.forward(&a)?)?;
        let h = self.mlp_norm.forward(&x)?;
        let mlp = (ops::silu(&self.gate.forward(&h)?)? * self.up.forward(&h)?)?;
        x + self.down.forward(&mlp)?
    }
}

/// Embeddings, blocks, a final norm, and logits through the embedding matrix (tied).
struct CharModel {
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
}

impl CharModel {
    fn new(vocab: usize, vb: VarBuilder) -> Result<Self> {
        let blocks = (0..LAYERS)
            .map(|i| Block::new(vb.pp(format!("block{i}"))))
            .collect::<Result<_>>()?;
        Ok(CharModel {
            embed: embedding(vocab, MODEL, vb.pp("embed"))?,
            blocks,
            norm: RmsNorm::new(vb.pp("norm"))?,
        })
    }

    /// Mean next-character cross-entropy (nats) of `[B, CONTEXT + 1]` token windows.
    fn loss(&self, windows: &Tensor) -> Result<Tensor> {
        let inputs = windows.narrow(1, 0, CONTEXT)?;
        let targets = windows.narrow(1, 1, CONTEXT)?.flatten_all()?;
        let mut x = self.embed.forward(&inputs)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        let x = self.norm.forward(&x)?.reshape(((), MODEL))?;
        let logits = x.matmul(&self.embed.embeddings().t()?)?;
        loss::cross_entropy(&logits, &targets)
    }
}

/// The text as character ids, with its alphabet.
struct Corpus {
    ids: Vec<u32>,
    alphabet: Vec<char>,
}

impl Corpus {
    fn read(path: &str) -> std::result::Result<Corpus, String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("{path}: {e}"))?;
        if !meta.is_file() {
            return Err(format!("{path}: not a regular file"));
        }
        if meta.len() > MAX_TEXT_BYTES {
            return Err(format!(
                "{path}: {} bytes; this example reads texts of at most {MAX_TEXT_BYTES}",
                meta.len()
            ));
        }
        let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
        let text = String::from_utf8(bytes).map_err(|e| format!("{path}: not UTF-8 text ({e})"))?;
        let alphabet: Vec<char> = text
            .chars()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let index: BTreeMap<char, u32> = alphabet.iter().zip(0..).map(|(&c, i)| (c, i)).collect();
        let ids: Vec<u32> = text.chars().map(|c| index[&c]).collect();
        // A tenth is held out; each part needs whole windows.
        if ids.len() < 10 * (CONTEXT + 1) {
            return Err(format!(
                "{path}: {} characters; training needs at least {}",
                ids.len(),
                10 * (CONTEXT + 1)
            ));
        }
        Ok(Corpus { ids, alphabet })
    }

    /// Cross-entropy (nats) of the held-out part under the training part's character
    /// frequencies, add-one smoothed.
    fn unigram_loss(&self, train: &[u32], held_out: &[u32]) -> f64 {
        let mut counts = vec![1.0f64; self.alphabet.len()];
        for &id in train {
            counts[id as usize] += 1.0;
        }
        let total: f64 = counts.iter().sum();
        let nats: f64 = held_out
            .iter()
            .map(|&id| -(counts[id as usize] / total).ln())
            .sum();
        nats / held_out.len() as f64
    }
}

/// `BATCH` windows of `CONTEXT + 1` ids from random places in `ids` (xorshift, fixed seed).
fn windows(ids: &[u32], rng: &mut XorShift) -> Result<Tensor> {
    let mut batch = Vec::with_capacity(BATCH * (CONTEXT + 1));
    for _ in 0..BATCH {
        let start = (rng.next_u64() % (ids.len() - CONTEXT) as u64) as usize;
        batch.extend_from_slice(&ids[start..start + CONTEXT + 1]);
    }
    Tensor::from_vec(batch, (BATCH, CONTEXT + 1), &Device::Cpu)
}

fn train(corpus: &Corpus) -> Result<bool> {
    let split = corpus.ids.len() * 9 / 10;
    let (train, held_out) = corpus.ids.split_at(split);
    let unigram = corpus.unigram_loss(train, held_out);
    println!(
        "{} characters, alphabet of {}; unigram model: {unigram:.3} nats/char on the held-out tenth",
        corpus.ids.len(),
        corpus.alphabet.len()
    );

    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = CharModel::new(corpus.alphabet.len(), vb)?;
    let vars: Vec<Var> = varmap.all_vars();
    let params = ParamsAdamW {
        lr: 3e-3,
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut opt = AdamW::new(vars, params)?;

    let bar = ProgressBar::new(STEPS as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps, {elapsed} {msg}")
            .expect("a fixed, valid template"),
    );
    let mut rng = XorShift::from_state(0x2545_F491_4F6C_DD1D).expect("a nonzero state");
    for step in 1..=STEPS {
        let loss = model.loss(&windows(train, &mut rng)?)?;
        opt.backward_step(&loss)?;
        bar.set_message(format!("loss {:.3}", loss.to_scalar::<f32>()?));
        bar.inc(1);
        if step % 50 == 0 {
            // Printed beside the bar, and also where the bar is hidden (output not a terminal).
            let line = format!("step {step}: training loss {:.3}", loss.to_scalar::<f32>()?);
            bar.suspend(|| println!("{line}"));
        }
    }
    bar.finish();

    let mut rng = XorShift::from_state(0x9E37_79B9_7F4A_7C15).expect("a nonzero state");
    let mut held_out_loss = 0.0;
    for _ in 0..8 {
        held_out_loss += f64::from(
            model
                .loss(&windows(held_out, &mut rng)?)?
                .to_scalar::<f32>()?,
        );
    }
    held_out_loss /= 8.0;
    let beaten = held_out_loss < unigram;
    println!(
        "held-out loss {held_out_loss:.3} nats/char against the unigram model's {unigram:.3}: {}",
        if beaten { "below it" } else { "NOT below it" }
    );
    Ok(beaten)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path] = &args[..] else {
        eprintln!(
            "usage: train_tiny TEXT_FILE (a UTF-8 text of at least {} characters)",
            10 * (CONTEXT + 1)
        );
        return ExitCode::from(2);
    };
    let corpus = match Corpus::read(path) {
        Ok(corpus) => corpus,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match train(&corpus) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
