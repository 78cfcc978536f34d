//! Text in and out: a checkpoint's `tokenizer.json`, read by the `tokenizers` crate (the Hugging
//! Face library's Rust core), and a decoder that streams generated text as tokens arrive.

use crate::error::RuntimeError;
use std::path::Path;

/// Largest tokenizer.json read (real ones are a few MiB).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Most tokens a stream holds back while they add no text or end in a partial character: no
/// character takes more than 4 bytes, so a longer run is not one that will complete, and is
/// given out as decoded (with its U+FFFD) rather than decoded again and again.
const MAX_HELD_TOKENS: usize = 16;

/// Bytes of memory the `tokenizers` crate takes per byte of text it tokenizes at once (about
/// 190 measured: its encoding keeps offsets, words and token strings beside the ids).
pub const TOKENIZER_BYTES_PER_BYTE: u64 = 200;

/// A checkpoint's tokenizer, or the bytes of UTF-8 text as ids 0 to 255 (a byte-level
/// research model's).
pub struct TextTokenizer {
    /// `None` for bytes.
    inner: Option<tokenizers::Tokenizer>,
    /// One past the largest token id it knows (added tokens included).
    ids: u64,
}

impl TextTokenizer {
    /// Text as its UTF-8 bytes, ids 0 to 255, and back (a character split across tokens waits
    /// for its last byte, as with byte-level tokenizers).
    pub fn bytes() -> TextTokenizer {
        TextTokenizer {
            inner: None,
            ids: 256,
        }
    }

    /// Reads `dir/tokenizer.json` (a regular file of at most 256 MiB). Its `padding` and
    /// `truncation` settings are dropped: transformers' `tokenizer(text)` applies neither.
    pub fn from_dir(dir: &Path) -> Result<TextTokenizer, RuntimeError> {
        TextTokenizer::read(
            &dir.join("tokenizer.json"),
            " (the checkpoint needs its tokenizer.json for text)",
        )
    }

    /// Reads a `tokenizer.json` file, as [`TextTokenizer::from_dir`].
    pub fn from_file(path: &Path) -> Result<TextTokenizer, RuntimeError> {
        TextTokenizer::read(path, "")
    }

    /// Reads `path`; `hint` follows a read error's message.
    fn read(path: &Path, hint: &str) -> Result<TextTokenizer, RuntimeError> {
        let bad = |message: String| RuntimeError::Io {
            path: path.display().to_string(),
            message,
        };
        let bytes = crate::files::read_bounded(path, MAX_TOKENIZER_BYTES, "tokenizer.json")
            .map_err(|e| match e {
                RuntimeError::Io { message, .. } => bad(format!("{message}{hint}")),
                other => other,
            })?;
        let mut inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| bad(format!("not a tokenizer this library reads: {e}")))?;
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| bad(format!("cannot turn truncation off: {e}")))?;
        let ids = inner
            .get_vocab(true)
            .values()
            .map(|&id| u64::from(id) + 1)
            .max()
            .unwrap_or(0);
        Ok(TextTokenizer {
            inner: Some(inner),
            ids,
        })
    }

    /// One past the largest token id the tokenizer knows (added tokens included).
    pub fn id_count(&self) -> u64 {
        self.ids
    }

    /// Refuses a tokenizer that names tokens past a model's vocabulary of `vocab` ids: its
    /// prompts would hold ids the model has no embedding for, so it is not the model's. A
    /// smaller tokenizer is allowed (checkpoints often pad their embedding to a round size);
    /// [`TextStream::push`] refuses a generated id it has no token for.
    pub fn check_fits(&self, vocab: usize) -> Result<(), RuntimeError> {
        if self.ids > vocab as u64 {
            return Err(RuntimeError::Data(format!(
                "tokenizer.json knows token ids up to {}, but the model's vocabulary has {vocab} \
                 ids: the tokenizer is not this model's",
                self.ids - 1
            )));
        }
        Ok(())
    }

    /// The token ids of `text`, with the special tokens the tokenizer's post-processor adds
    /// (as transformers' `tokenizer(text)` does).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        let Some(inner) = &self.inner else {
            return Ok(text.bytes().map(u32::from).collect());
        };
        let encoding = inner
            .encode(text, true)
            .map_err(|e| RuntimeError::Data(format!("cannot tokenize the prompt: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The token ids of `text`, or an error when they are more than `limit`, found without
    /// tokenizing all of a long text at once: a text of more than a piece is counted a piece
    /// at a time (pieces ending at line breaks, [`pieces`]) and refused as soon as the count
    /// passes `limit`; one that fits is then tokenized whole (the ids of the whole can differ
    /// from the pieces' where a piece boundary splits what the tokenizer would join), its
    /// memory checked first. `what` names the text in errors.
    pub fn encode_within(
        &self,
        text: &str,
        limit: usize,
        what: &str,
    ) -> Result<Vec<u32>, RuntimeError> {
        let too_many = |at_least: usize| {
            RuntimeError::Data(format!(
                "{what} is {at_least} tokens or more; allowed: at most {limit}"
            ))
        };
        if text.len() > PIECE_BYTES && self.inner.is_some() {
            let mut count = 0usize;
            for (i, piece) in pieces(text, PIECE_BYTES).enumerate() {
                count += if i == 0 {
                    self.encode(piece)?.len()
                } else {
                    self.encode_plain(piece)?.len()
                };
                if count > limit {
                    return Err(too_many(count));
                }
            }
            let need = (text.len() as u64).saturating_mul(TOKENIZER_BYTES_PER_BYTE);
            crate::memory::ensure_fits(&format!("tokenizing {what}"), Some(need))?;
        }
        let ids = self.encode(text)?;
        if ids.len() > limit {
            return Err(too_many(ids.len()));
        }
        Ok(ids)
    }

    /// The token ids of `text` without special tokens: a piece of a longer text, tokenized
    /// after its first piece.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        let Some(inner) = &self.inner else {
            return Ok(text.bytes().map(u32::from).collect());
        };
        let encoding = inner
            .encode(text, false)
            .map_err(|e| RuntimeError::Data(format!("cannot tokenize the text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids` (special tokens kept, as transformers' `decode` does by default).
    pub fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
        let Some(inner) = &self.inner else {
            let bytes: Option<Vec<u8>> = ids.iter().map(|&id| u8::try_from(id).ok()).collect();
            return bytes
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .ok_or_else(|| RuntimeError::Data(format!("ids past 255 are no bytes: {ids:?}")));
        };
        inner.decode(ids, false).map_err(|e| {
            let shown: Vec<u32> = ids.iter().copied().take(16).collect();
            RuntimeError::Data(format!("cannot decode tokens {shown:?}: {e}"))
        })
    }

    /// A decoder for a stream of generated tokens.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tokenizer: self,
            window: Vec::new(),
            settled: 0,
            settled_text: String::new(),
        }
    }
}

/// Bytes of text tokenized at a time when a long text is counted or tokenized in pieces.
pub const PIECE_BYTES: usize = 256 << 10;

/// `text` in pieces of at most `max` bytes (at least 4), each ending at the last line break
/// within them, or at the last character boundary where a line is longer; together they are
/// the text.
pub fn pieces(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let max = max.max(4);
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let piece = if rest.len() <= max {
            rest
        } else {
            let mut end = max;
            while !rest.is_char_boundary(end) {
                end -= 1;
            }
            match rest[..end].rfind('\n') {
                Some(line) if line > 0 => &rest[..=line],
                _ => &rest[..end],
            }
        };
        rest = &rest[piece.len()..];
        Some(piece)
    })
}

/// Generated text, piece by piece, in time linear in the tokens.
///
/// Each token is decoded in a short window that starts at the tokens of the last piece given
/// out (their text is known, so the new piece is what the window's text adds to it: a decoder
/// that joins tokens with spaces or strips a leading one sees the same context as it would in
/// the whole text). Byte-level tokens may split a character: the window's text then ends in
/// U+FFFD until the rest arrives, so that tail is held back and given out by
/// [`TextStream::finish`] if it never completes. The pieces add up to the decoding of all the
/// tokens at once.
pub struct TextStream<'t> {
    tokenizer: &'t TextTokenizer,
    /// The tokens of the last piece given out, then those held back.
    window: Vec<u32>,
    /// How many of `window` were given out already.
    settled: usize,
    /// The text of `window[..settled]`.
    settled_text: String,
}

impl TextStream<'_> {
    /// Adds a token; returns the text it completes (possibly empty). A token the tokenizer has
    /// no text for is an error: the model and the tokenizer do not belong together.
    pub fn push(&mut self, id: u32) -> Result<String, RuntimeError> {
        if u64::from(id) >= self.tokenizer.ids {
            return Err(RuntimeError::Data(format!(
                "the model produced token {id}, which tokenizer.json has no text for (it knows \
                 ids below {}): the tokenizer is not this model's",
                self.tokenizer.ids
            )));
        }
        self.window.push(id);
        let text = self.tokenizer.decode(&self.window)?;
        let held = self.window.len() - self.settled;
        let adds = text.len() > self.settled_text.len() && !text.ends_with('\u{fffd}');
        if !adds && held < MAX_HELD_TOKENS {
            return Ok(String::new());
        }
        Ok(self.settle(text))
    }

    /// The text still held back, once no token will follow.
    pub fn finish(&mut self) -> Result<String, RuntimeError> {
        let text = self.tokenizer.decode(&self.window)?;
        Ok(self.settle(text))
    }

    /// Gives out what `text` (the window's text) adds to the settled text, and starts the next
    /// window at the tokens just given out.
    fn settle(&mut self, text: String) -> String {
        let piece = match text.strip_prefix(self.settled_text.as_str()) {
            Some(piece) => piece.to_string(),
            // A decoder that rewrote earlier text: what was given out stands; the rest is the
            // text past its length.
            None => text
                .get(self.settled_text.len().min(text.len())..)
                .unwrap_or_default()
                .to_string(),
        };
        self.window.drain(..self.settled);
        self.settled = self.window.len();
        self.settled_text = self
            .tokenizer
            .decode(&self.window)
            .unwrap_or_else(|_| text[text.len() - piece.len()..].to_string());
        piece
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pieces_end_at_line_breaks_or_characters_and_cover_the_text() {
        let line = "héllo wörld, the quick brown fox\n";
        let text = line.repeat(3 * PIECE_BYTES / line.len());
        let mut joined = String::new();
        let all: Vec<&str> = pieces(&text, PIECE_BYTES).collect();
        for (i, piece) in all.iter().enumerate() {
            assert!(piece.len() <= PIECE_BYTES && !piece.is_empty());
            if i + 1 < all.len() {
                assert!(piece.ends_with('\n'), "{:?}", &piece[piece.len() - 10..]);
            }
            joined.push_str(piece);
        }
        assert_eq!(joined, text);
        // One long line of two-byte characters: cut at a character boundary.
        let wide = "é".repeat(PIECE_BYTES);
        assert_eq!(
            pieces(&wide, PIECE_BYTES).next().unwrap().len(),
            PIECE_BYTES
        );
        let odd = format!("x{wide}");
        assert_eq!(
            pieces(&odd, PIECE_BYTES).next().unwrap().len(),
            PIECE_BYTES - 1
        );
    }

    #[test]
    fn bytes_are_text_and_back() {
        let t = TextTokenizer::bytes();
        let ids = t.encode("héllo").unwrap();
        assert_eq!(ids, [104, 195, 169, 108, 108, 111]);
        assert_eq!(t.decode(&ids).unwrap(), "héllo");
        // A character split across tokens waits for its last byte.
        let mut stream = t.stream();
        let pieces: Vec<String> = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
        assert_eq!(pieces, ["h", "", "é", "l", "l", "o"]);
        assert!(
            stream
                .push(256)
                .unwrap_err()
                .to_string()
                .contains("no text for")
        );
        let e = t
            .encode_within("hello", 3, "the prompt")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the prompt is 5 tokens or more; allowed: at most 3"),
            "{e}"
        );
    }

    use super::*;

    fn tokenizer() -> TextTokenizer {
        let dir =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf-tiny/llama_tokenizer");
        TextTokenizer::from_dir(&dir).unwrap()
    }

    /// Each token is decoded in a window of the last piece's tokens and those held back, never
    /// in the whole text so far: a long stream costs time linear in its length.
    #[test]
    fn the_decoding_window_stays_short_however_long_the_stream() {
        let t = tokenizer();
        let ids = t
            .encode(&"the quick brown fox, héllo wörld. ".repeat(200))
            .unwrap();
        let mut stream = t.stream();
        let mut text = String::new();
        let mut widest = 0;
        for &id in &ids {
            text += &stream.push(id).unwrap();
            widest = widest.max(stream.window.len());
        }
        text += &stream.finish().unwrap();
        assert!(ids.len() > 1000, "{}", ids.len());
        assert!(widest <= 2 * MAX_HELD_TOKENS, "a window of {widest} tokens");
        assert_eq!(text, t.decode(&ids).unwrap());
    }

    #[test]
    fn a_run_of_tokens_that_never_completes_a_character_is_given_out_after_a_bound() {
        let t = tokenizer();
        // A lone UTF-8 lead byte, over and over: the text ends in U+FFFD for good.
        let lead = t
            .encode("é")
            .unwrap()
            .into_iter()
            .find(|&id| t.decode(&[id]).unwrap().ends_with('\u{fffd}'))
            .expect("the byte-level vocabulary splits é into byte tokens");
        let mut stream = t.stream();
        let given: usize = (0..4 * MAX_HELD_TOKENS)
            .map(|_| stream.push(lead).unwrap().len())
            .sum();
        assert!(given > 0, "nothing was given out");
        assert!(stream.window.len() <= 2 * MAX_HELD_TOKENS);
    }
}
