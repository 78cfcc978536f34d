//! The training text as token ids, split into training and validation, and random windows of
//! it.

use attn::candle::core::{Device, Tensor};
use attn::runtime::model::TextTokenizer;
use std::path::Path;

/// Largest corpus read (bytes).
const MAX_CORPUS_BYTES: u64 = 1 << 30;

/// Token ids: the first 90% for training, the last 10% for validation.
pub struct Corpus {
    pub train: Vec<u32>,
    pub validation: Vec<u32>,
}

/// Reads and tokenizes `path`: bytes, or `tokenizer`'s ids, checked against the model's
/// `vocab`; both parts must hold a window of `seq + 1` tokens.
pub fn read(
    path: &Path,
    tokenizer: Option<&Path>,
    vocab: usize,
    seq: usize,
) -> Result<Corpus, String> {
    let shown = path.display();
    let bytes = attn::runtime::files::read_bounded(path, MAX_CORPUS_BYTES, "the corpus")
        .map_err(|e| format!("error: --data: {e}"))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        format!("error: --data {shown}: not UTF-8 text ({e}); training takes a text file")
    })?;
    let tokens: Vec<u32> = match tokenizer {
        None => {
            if vocab != 256 {
                return Err(format!(
                    "error: the model's vocab is {vocab}, but training without --tokenizer reads \
                     bytes, 256 ids: set vocab = 256, or give the tokenizer.json of a {vocab}-id \
                     vocabulary"
                ));
            }
            text.bytes().map(u32::from).collect()
        }
        Some(file) => {
            let t =
                TextTokenizer::from_file(file).map_err(|e| format!("error: --tokenizer: {e}"))?;
            t.check_fits(vocab)
                .map_err(|e| format!("error: --tokenizer: {e}"))?;
            t.encode(&text)
                .map_err(|e| format!("error: --data {shown}: {e}"))?
        }
    };
    let split = tokens.len() - tokens.len() / 10;
    let (train, validation) = tokens.split_at(split);
    if train.len() <= seq || validation.len() <= seq {
        return Err(format!(
            "error: --data {shown}: {} tokens, too few: the last tenth is the validation set, and \
             each part needs a window of --seq + 1 = {} tokens (at least {} tokens in all)",
            tokens.len(),
            seq + 1,
            10 * (seq + 1)
        ));
    }
    Ok(Corpus {
        train: train.to_vec(),
        validation: validation.to_vec(),
    })
}

impl Corpus {
    /// The validation set's cross-entropy (nats per token) under the training set's token
    /// frequencies, add-one smoothed over `vocab` ids: the loss a model must beat to have
    /// learned more than which tokens are common.
    pub fn unigram_loss(&self, vocab: usize) -> f64 {
        let mut counts = vec![1.0f64; vocab];
        for &id in &self.train {
            counts[id as usize] += 1.0;
        }
        let total: f64 = counts.iter().sum();
        let nats: f64 = self
            .validation
            .iter()
            .map(|&id| -(counts[id as usize] / total).ln())
            .sum();
        nats / self.validation.len() as f64
    }
}

/// The batches' generator: the windows a run draws depend on its seed alone.
pub type Rng = attn::inputs::XorShift;

/// `batch` windows of `seq + 1` tokens from random places in `tokens`, `[batch, seq + 1]`.
pub fn windows(tokens: &[u32], batch: usize, seq: usize, rng: &mut Rng) -> Tensor {
    let starts = tokens.len() - seq;
    let mut ids = Vec::with_capacity(batch * (seq + 1));
    for _ in 0..batch {
        let start = (rng.next_u64() % starts as u64) as usize;
        ids.extend_from_slice(&tokens[start..start + seq + 1]);
    }
    Tensor::from_vec(ids, (batch, seq + 1), &Device::Cpu)
        .expect("batch * (seq + 1) ids fill that shape")
}
