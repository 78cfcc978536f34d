//! Errors of attn-dsl: located spec errors (for strings; the macro uses syn's errors directly),
//! validation findings, and reference shape errors.

use std::fmt;

/// A position in spec source text: 1-based line, 1-based column (in characters).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Location {
    /// Line, from 1.
    pub line: usize,
    /// Column, from 1.
    pub column: usize,
}

/// One error in a spec string, with where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    /// What is wrong and what is allowed.
    pub message: String,
    /// Where the offending tokens start.
    pub start: Location,
    /// Where they end (exclusive).
    pub end: Location,
}

/// Every error found in a spec string (at least one).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct SpecErrors(pub Vec<SpecError>);

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "{}:{}: {}",
            self.start.line, self.start.column, self.message
        )
    }
}

impl fmt::Display for SpecErrors {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl SpecErrors {
    /// Renders every error with the source line and a caret under the offending tokens, the way
    /// compilers do.
    pub fn render(&self, source: &str) -> String {
        self.0
            .iter()
            .map(|e| e.render(source))
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub(crate) fn from_syn(err: syn::Error) -> SpecErrors {
        SpecErrors(
            err.into_iter()
                .map(|e| {
                    let span = e.span();
                    let (start, end) = (span.start(), span.end());
                    SpecError {
                        message: e.to_string(),
                        start: Location {
                            line: start.line.max(1),
                            column: start.column + 1,
                        },
                        end: Location {
                            line: end.line.max(1),
                            column: end.column + 1,
                        },
                    }
                })
                .collect(),
        )
    }
}

impl SpecError {
    /// Renders the error with the source line and carets under the offending tokens.
    pub fn render(&self, source: &str) -> String {
        let mut out = format!("error: {}\n", self.message);
        let Some(text) = source.lines().nth(self.start.line - 1) else {
            return out;
        };
        let gutter = self.start.line.to_string().len();
        let width = if self.end.line == self.start.line && self.end.column > self.start.column {
            self.end.column - self.start.column
        } else {
            1
        };
        let pad = " ".repeat(gutter);
        out += &format!(
            "{pad}--> {}:{}\n{pad} |\n{} | {text}\n{pad} | {}{}\n",
            self.start.line,
            self.start.column,
            self.start.line,
            " ".repeat(self.start.column - 1),
            "^".repeat(width)
        );
        out
    }
}

/// A rule a spec breaks, found by [`crate::AttentionSpec::validate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid {
    /// Dotted path of the offending field, e.g. `kv_heads` or `position.scaling.factor`.
    pub field: &'static str,
    /// What is wrong, and what is allowed.
    pub message: String,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Bad inputs to the reference implementation.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    /// A tensor's shape does not fit the spec or the other tensors.
    #[error("tensor `{name}` has shape {found:?}, expected {expected}")]
    Shape {
        /// Which input.
        name: &'static str,
        /// The shape it has.
        found: Vec<usize>,
        /// The shape it should have, in words.
        expected: String,
    },
    /// The spec itself is invalid.
    #[error("invalid spec: {0}")]
    Spec(String),
    /// The spec needs a different entry point (MLA vs. per-head KV).
    #[error("{0}")]
    WrongEntryPoint(&'static str),
}
