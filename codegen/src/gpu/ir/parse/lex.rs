//! The GPU IR text split into tokens, each with its byte span, and the parser's error type.

use std::fmt;

/// A parse error at a line and column (1-based).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// Line of the offending token.
    pub line: usize,
    /// Column of its first character.
    pub column: usize,
    /// What was wrong, and what was expected.
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.line, self.column, self.message)
    }
}

impl std::error::Error for ParseError {}

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Tok {
    /// A word: letters, digits, `_` and inner `.` (`ld.global.f32`, `ctaid.x`, `inf`).
    Word(String),
    /// A number as written (`12`, `0.5`, `1e-5`).
    Number(String),
    /// `%name`.
    Reg(String),
    /// `$name`.
    Param(String),
    /// Punctuation and operators.
    Punct(&'static str),
    End,
}

impl fmt::Display for Tok {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Word(w) | Tok::Number(w) => write!(f, "`{w}`"),
            Tok::Reg(r) => write!(f, "`%{r}`"),
            Tok::Param(p) => write!(f, "`${p}`"),
            Tok::Punct(p) => write!(f, "`{p}`"),
            Tok::End => write!(f, "the end of the text"),
        }
    }
}

/// Operators, longest first.
const PUNCT: [&str; 21] = [
    "..", "<<", "<=", ">=", "==", "!=", "(", ")", "[", "]", "{", "}", ",", ":", "=", "+", "-", "*",
    "/", "%", "<",
];

const PUNCT_MORE: [&str; 4] = [">", "&", "|", "?"];

pub(super) fn lex(text: &str) -> Result<Vec<(Tok, usize, usize)>, ParseError> {
    let mut out = Vec::new();
    for (l, line) in text.lines().enumerate() {
        if line.trim_start().starts_with('#') {
            continue;
        }
        let chars: Vec<char> = line.chars().collect();
        let mut i = 0;
        let word_char = |c: char| c.is_ascii_alphanumeric() || c == '_';
        // A word continues through `.` followed by a word character (not `..`).
        let word_end = |mut j: usize| {
            while j < chars.len()
                && (word_char(chars[j])
                    || (chars[j] == '.' && chars.get(j + 1).is_some_and(|c| word_char(*c))))
            {
                j += 1;
            }
            j
        };
        while i < chars.len() {
            let c = chars[i];
            let at = (l + 1, i + 1);
            if c.is_whitespace() {
                i += 1;
                continue;
            }
            let take = |j: usize| chars[i..j].iter().collect::<String>();
            if (c == '%' || c == '$') && chars.get(i + 1).is_some_and(|c| word_char(*c)) {
                let j = word_end(i + 1);
                let name: String = chars[i + 1..j].iter().collect();
                out.push((
                    if c == '%' {
                        Tok::Reg(name)
                    } else {
                        Tok::Param(name)
                    },
                    at.0,
                    at.1,
                ));
                i = j;
            } else if c.is_ascii_digit() {
                let mut j = i;
                while j < chars.len() && chars[j].is_ascii_digit() {
                    j += 1;
                }
                if chars.get(j) == Some(&'.')
                    && chars.get(j + 1).is_some_and(|c| c.is_ascii_digit())
                {
                    j += 1;
                    while j < chars.len() && chars[j].is_ascii_digit() {
                        j += 1;
                    }
                }
                if matches!(chars.get(j), Some('e' | 'E')) {
                    let mut k = j + 1;
                    if matches!(chars.get(k), Some('+' | '-')) {
                        k += 1;
                    }
                    if chars.get(k).is_some_and(|c| c.is_ascii_digit()) {
                        j = k;
                        while j < chars.len() && chars[j].is_ascii_digit() {
                            j += 1;
                        }
                    }
                }
                out.push((Tok::Number(take(j)), at.0, at.1));
                i = j;
            } else if word_char(c) {
                let j = word_end(i);
                out.push((Tok::Word(take(j)), at.0, at.1));
                i = j;
            } else if let Some(p) = PUNCT
                .iter()
                .chain(&PUNCT_MORE)
                .find(|p| chars[i..].iter().take(p.len()).copied().eq(p.chars()))
            {
                out.push((Tok::Punct(p), at.0, at.1));
                i += p.len();
            } else {
                return Err(ParseError {
                    line: at.0,
                    column: at.1,
                    message: format!("unexpected character `{c}`"),
                });
            }
        }
    }
    let end = text.lines().count() + 1;
    out.push((Tok::End, end, 1));
    Ok(out)
}
