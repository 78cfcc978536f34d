//! Text in and out: a checkpoint's `tokenizer.json`, read by the `tokenizers` crate (the Hugging
//! Face library's Rust core), and a decoder that streams generated text as tokens arrive.

use crate::error::RuntimeError;
use std::path::Path;

/// Largest tokenizer.json read (real ones are a few MiB).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// A checkpoint's tokenizer.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
}

impl TextTokenizer {
    /// Reads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<TextTokenizer, RuntimeError> {
        let path = dir.join("tokenizer.json");
        let bad = |message: String| RuntimeError::Io {
            path: path.display().to_string(),
            message,
        };
        let size = std::fs::metadata(&path)
            .map_err(|e| {
                bad(format!(
                    "{e} (the checkpoint needs its tokenizer.json for text)"
                ))
            })?
            .len();
        if size > MAX_TOKENIZER_BYTES {
            return Err(bad(format!(
                "{size} bytes; allowed: at most {MAX_TOKENIZER_BYTES}"
            )));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| bad(format!("not a tokenizer this library reads: {e}")))?;
        Ok(TextTokenizer { inner })
    }

    /// The token ids of `text`, with the special tokens the tokenizer's post-processor adds
    /// (as transformers' `tokenizer(text)` does).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| RuntimeError::Data(format!("cannot tokenize the prompt: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids` (special tokens kept, as transformers' `decode` does by default).
    pub fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| RuntimeError::Data(format!("cannot decode tokens {ids:?}: {e}")))
    }

    /// A decoder for a stream of generated tokens.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tokenizer: self,
            ids: Vec::new(),
            shown: 0,
        }
    }
}

/// Generated text, piece by piece. Byte-level tokens may split a character: the text of the
/// tokens so far then ends in U+FFFD until the rest arrives, so that tail is held back (it may
/// still change) and given out by [`TextStream::finish`] if it never completes. The pieces add up
/// to the decoding of all the tokens at once.
pub struct TextStream<'t> {
    tokenizer: &'t TextTokenizer,
    ids: Vec<u32>,
    /// Bytes of the decoded text already given out.
    shown: usize,
}

impl TextStream<'_> {
    /// Adds a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, RuntimeError> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids)?;
        let stable = text.trim_end_matches('\u{fffd}').len();
        Ok(self.take(&text, stable))
    }

    /// The text still held back, once no token will follow.
    pub fn finish(&mut self) -> Result<String, RuntimeError> {
        let text = self.tokenizer.decode(&self.ids)?;
        Ok(self.take(&text, text.len()))
    }

    /// `text[shown..upto]`: the part not given out yet.
    fn take(&mut self, text: &str, upto: usize) -> String {
        if upto <= self.shown || !text.is_char_boundary(self.shown) {
            return String::new();
        }
        let piece = text[self.shown..upto].to_string();
        self.shown = upto;
        piece
    }
}
