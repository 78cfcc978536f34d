//! The training text as token ids, split into training and validation, and random windows of
//! it; for packed training (`--pack`), where each document starts, and each window's tokens'
//! document ids.
//!
//! Memory: a byte-level corpus is kept as its bytes (about 1.1 times the file: the validation
//! tenth is copied out once); a tokenized one as the text while it is tokenized, a piece at a
//! time, then as 32-bit ids. The cost is checked against the memory available before the file
//! is read.

use super::state::DataPrint;
use attn::candle::core::{Device, Tensor};
use attn::codegen::gpu::ir::target::bytes_hash;
use attn::runtime::model::{PIECE_BYTES, TOKENIZER_BYTES_PER_BYTE, TextTokenizer, pieces};
use std::path::Path;

/// Largest corpus read (bytes).
pub const MAX_CORPUS_BYTES: u64 = 1 << 30;

/// Token ids: bytes for a byte-level model, else 32-bit ids.
pub enum Ids {
    Bytes(Vec<u8>),
    Wide(Vec<u32>),
}

impl Ids {
    pub fn len(&self) -> usize {
        match self {
            Ids::Bytes(b) => b.len(),
            Ids::Wide(w) => w.len(),
        }
    }

    /// The ids from `at` on, taken out of `self`.
    fn split_off(&mut self, at: usize) -> Ids {
        let tail = match self {
            Ids::Bytes(b) => Ids::Bytes(b.split_off(at)),
            Ids::Wide(w) => Ids::Wide(w.split_off(at)),
        };
        match self {
            Ids::Bytes(b) => b.shrink_to_fit(),
            Ids::Wide(w) => w.shrink_to_fit(),
        }
        tail
    }

    /// Appends the ids `range` to `out`.
    fn extend_into(&self, range: std::ops::Range<usize>, out: &mut Vec<u32>) {
        match self {
            Ids::Bytes(b) => out.extend(b[range].iter().map(|&x| u32::from(x))),
            Ids::Wide(w) => out.extend_from_slice(&w[range]),
        }
    }

    fn for_each(&self, mut f: impl FnMut(usize)) {
        match self {
            Ids::Bytes(b) => b.iter().for_each(|&x| f(usize::from(x))),
            Ids::Wide(w) => w.iter().for_each(|&x| f(x as usize)),
        }
    }
}

/// The first 90% of the ids for training, the last 10% for validation, and which corpus it is.
pub struct Corpus {
    pub train: Ids,
    pub validation: Ids,
    pub print: DataPrint,
    /// For packed training: the index of each document's first token after the first, in
    /// `train` and in `validation`.
    pub documents: Option<(Vec<usize>, Vec<usize>)>,
}

/// Where documents start in `ids`: after each occurrence of `separator` (token or byte ids).
fn document_starts(ids: &[u32], separator: &[u32]) -> Vec<usize> {
    if separator.is_empty() {
        return Vec::new();
    }
    let mut starts = Vec::new();
    let mut at = 0;
    while at + separator.len() <= ids.len() {
        if ids[at..at + separator.len()] == *separator {
            at += separator.len();
            starts.push(at);
        } else {
            at += 1;
        }
    }
    starts.retain(|&s| s < ids.len());
    starts
}

/// Reads and tokenizes `path`: bytes, or `tokenizer`'s ids, checked against the model's
/// `vocab`; both parts must hold a window of `seq + 1` tokens.
pub fn read(
    path: &Path,
    tokenizer: Option<&Path>,
    vocab: usize,
    seq: usize,
    pack: Option<&str>,
) -> Result<Corpus, String> {
    let shown = path.display();
    if tokenizer.is_none() && vocab != 256 {
        return Err(format!(
            "error: the model's vocab is {vocab}, but training without --tokenizer reads \
             bytes, 256 ids: set vocab = 256, or give the tokenizer.json of a {vocab}-id \
             vocabulary"
        ));
    }
    let size = std::fs::metadata(path)
        .map_err(|e| format!("error: --data {shown}: {e}"))?
        .len();
    if size > MAX_CORPUS_BYTES {
        return Err(format!(
            "error: --data {shown}: {size} bytes; allowed: at most {MAX_CORPUS_BYTES} (1 GiB)"
        ));
    }
    // The text, and for a tokenizer up to 4 bytes of ids per byte of text (no tokenizer makes
    // more ids than bytes, bar a few special ones) and one piece's tokenizer memory.
    let need = match tokenizer {
        None => size + size / 10,
        Some(_) => 5 * size + TOKENIZER_BYTES_PER_BYTE * PIECE_BYTES as u64,
    };
    attn::runtime::memory::ensure_fits("the corpus", Some(need))
        .map_err(|e| format!("error: --data {shown}: {e}"))?;
    let bytes = attn::runtime::files::read_bounded(path, MAX_CORPUS_BYTES, "the corpus")
        .map_err(|e| format!("error: --data: {e}"))?;
    let text = std::str::from_utf8(&bytes).map_err(|e| {
        format!("error: --data {shown}: not UTF-8 text ({e}); training takes a text file")
    })?;
    let mut hash = bytes_hash(text.as_bytes());
    let mut ids = match tokenizer {
        None => Ids::Bytes(bytes),
        Some(file) => {
            let t =
                TextTokenizer::from_file(file).map_err(|e| format!("error: --tokenizer: {e}"))?;
            t.check_fits(vocab)
                .map_err(|e| format!("error: --tokenizer: {e}"))?;
            let ids = tokenize(&t, text).map_err(|e| format!("error: --data {shown}: {e}"))?;
            let json = attn::runtime::files::read_bounded(file, 256 << 20, "tokenizer.json")
                .map_err(|e| format!("error: --tokenizer: {e}"))?;
            hash = bytes_hash(format!("{hash} {}", bytes_hash(&json)).as_bytes());
            Ids::Wide(ids)
        }
    };
    let total = ids.len();
    // Packed: documents start after each separator (its ids as the corpus has them).
    let starts = match (pack, &ids) {
        (None, _) => None,
        (Some(sep), Ids::Bytes(b)) => {
            let all: Vec<u32> = b.iter().map(|&x| u32::from(x)).collect();
            let sep: Vec<u32> = sep.bytes().map(u32::from).collect();
            Some(document_starts(&all, &sep))
        }
        (Some(sep), Ids::Wide(w)) => {
            let file = tokenizer.expect("wide ids come from a tokenizer");
            let t =
                TextTokenizer::from_file(file).map_err(|e| format!("error: --tokenizer: {e}"))?;
            let sep = t
                .encode_plain(sep)
                .map_err(|e| format!("error: --pack: the separator: {e}"))?;
            Some(document_starts(w, &sep))
        }
    };
    let validation = ids.split_off(total - total / 10);
    let documents = starts.map(|all| {
        let cut = ids.len();
        let train = all.iter().copied().filter(|&s| s < cut).collect();
        let validation = all.iter().filter(|&&s| s > cut).map(|s| s - cut).collect();
        (train, validation)
    });
    if ids.len() <= seq || validation.len() <= seq {
        let s = if total == 1 { "" } else { "s" };
        return Err(format!(
            "error: --data {shown}: {total} token{s}, too few: the last tenth is the validation \
             set, and each part needs a window of --seq + 1 = {} tokens (at least {} tokens in \
             all)",
            seq + 1,
            10 * (seq + 1)
        ));
    }
    Ok(Corpus {
        train: ids,
        validation,
        documents,
        print: DataPrint {
            path: std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()),
            tokens: total as u64,
            hash,
        },
    })
}

/// `text`'s ids, tokenized a piece at a time ([`pieces`]: the tokenizer's memory grows with
/// what it is given): the first with the tokenizer's special tokens (as `tokenizer(text)`
/// adds them), the rest without.
fn tokenize(t: &TextTokenizer, text: &str) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    for (i, piece) in pieces(text, PIECE_BYTES).enumerate() {
        let more = if i == 0 {
            t.encode(piece)
        } else {
            t.encode_plain(piece)
        }
        .map_err(|e| e.to_string())?;
        ids.extend_from_slice(&more);
    }
    Ok(ids)
}

impl Corpus {
    /// The validation set's cross-entropy (nats per token) under the training set's token
    /// frequencies, add-one smoothed over `vocab` ids: the loss a model must beat to have
    /// learned more than which tokens are common.
    pub fn unigram_loss(&self, vocab: usize) -> f64 {
        let mut counts = vec![1.0f64; vocab];
        self.train.for_each(|id| counts[id] += 1.0);
        let total: f64 = counts.iter().sum();
        let mut nats = 0.0;
        self.validation
            .for_each(|id| nats -= (counts[id] / total).ln());
        nats / self.validation.len() as f64
    }
}

/// The batches' generator: the windows a run draws depend on its seed alone.
pub type Rng = attn::inputs::XorShift;

/// `batch` windows of `seq + 1` tokens from random places in `tokens`, `[batch, seq + 1]`,
/// and for packed training (`documents`: where `tokens`' documents start) each token's
/// document id, counted from the window's first document (U32, the same shape).
pub fn windows(
    tokens: &Ids,
    documents: Option<&[usize]>,
    batch: usize,
    seq: usize,
    rng: &mut Rng,
) -> (Tensor, Option<Tensor>) {
    let starts = tokens.len() - seq;
    let mut ids = Vec::with_capacity(batch * (seq + 1));
    let mut docs = Vec::new();
    for _ in 0..batch {
        let start = (rng.next_u64() % starts as u64) as usize;
        tokens.extend_into(start..start + seq + 1, &mut ids);
        if let Some(d) = documents {
            // Documents begun at or before each token, less those before the window.
            let first = d.partition_point(|&s| s <= start);
            let mut next = first;
            for at in start..start + seq + 1 {
                while next < d.len() && d[next] <= at {
                    next += 1;
                }
                docs.push((next - first) as u32);
            }
        }
    }
    let shape = (batch, seq + 1);
    let tensor = |v: Vec<u32>| {
        Tensor::from_vec(v, shape, &Device::Cpu).expect("batch * (seq + 1) ids fill that shape")
    };
    (tensor(ids), documents.map(|_| tensor(docs)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_start_after_each_separator_and_number_a_window() {
        let ids: Vec<u32> = b"ab\n\ncd\n\n\nef".iter().map(|&x| u32::from(x)).collect();
        let starts = document_starts(&ids, &[10, 10]);
        assert_eq!(starts, vec![4, 8]);
        let tokens = Ids::Bytes(b"ab\n\ncd\n\n\nef".to_vec());
        let mut rng = Rng::new(3);
        let (w, d) = windows(&tokens, Some(&starts), 4, 5, &mut rng);
        let (w, d) = (
            w.to_vec2::<u32>().unwrap(),
            d.unwrap().to_vec2::<u32>().unwrap(),
        );
        // Token p is in document `starts <= p`; a window counts from its first token's.
        let doc_of = |p: usize| starts.iter().filter(|&&s| s <= p).count() as u32;
        for (row, docs) in w.iter().zip(&d) {
            let fits = (0..=ids.len() - row.len()).any(|start| {
                ids[start..start + row.len()] == row[..]
                    && (0..row.len()).all(|i| docs[i] == doc_of(start + i) - doc_of(start))
            });
            assert!(fits, "{row:?} {docs:?}");
        }
    }

    #[test]
    fn a_text_tokenized_in_pieces_has_the_ids_of_the_whole() {
        let path = format!(
            "{}/tests/fixtures/hf-tiny/llama_tokenizer/tokenizer.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let t = TextTokenizer::from_file(Path::new(&path)).unwrap();
        let line = "The quick brown fox, héllo wörld.\n  indented line\n";
        let text = line.repeat(2 * PIECE_BYTES / line.len() + 7);
        assert!(text.len() > 2 * PIECE_BYTES);
        assert_eq!(tokenize(&t, &text).unwrap(), t.encode(&text).unwrap());
    }
}
