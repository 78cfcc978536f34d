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

/// Most errors [`SpecErrors::render`] shows; it counts the rest.
const RENDERED_ERRORS: usize = 20;
/// Most characters of a source line shown around a caret.
const LINE_WINDOW: usize = 100;

impl SpecErrors {
    /// Renders the first errors with the source line and a caret under the offending tokens,
    /// the way compilers do, and counts the rest. Long lines are shown as a window around the
    /// caret, so the output stays small whatever the input.
    pub fn render(&self, source: &str) -> String {
        let mut out: Vec<String> = self
            .0
            .iter()
            .take(RENDERED_ERRORS)
            .map(|e| e.render(source))
            .collect();
        let hidden = self.0.len().saturating_sub(RENDERED_ERRORS);
        if hidden > 0 {
            out.push(format!(
                "... and {hidden} more error{}\n",
                if hidden == 1 { "" } else { "s" }
            ));
        }
        out.join("\n")
    }

    pub(crate) fn from_syn(err: syn::Error) -> SpecErrors {
        SpecErrors(
            err.into_iter()
                .map(|e| SpecError::at(e.to_string(), e.span()))
                .collect(),
        )
    }
}

impl SpecError {
    /// `message` at the tokens of `span` (a span of tokens parsed from a string).
    pub(crate) fn at(message: String, span: proc_macro2::Span) -> SpecError {
        let (start, end) = (span.start(), span.end());
        SpecError {
            message,
            start: Location {
                line: start.line.max(1),
                column: start.column + 1,
            },
            end: Location {
                line: end.line.max(1),
                column: end.column + 1,
            },
        }
    }

    /// Renders the error with the source line and carets under the offending tokens. A line
    /// longer than a screen is cut to a window around the caret, marked `...` where cut.
    pub fn render(&self, source: &str) -> String {
        self.render_as("error", source)
    }

    /// [`SpecError::render`] under another label (`note` for a remark that rejects nothing).
    pub fn render_as(&self, label: &str, source: &str) -> String {
        let mut out = format!("{label}: {}\n", self.message);
        let Some(text) = source.lines().nth(self.start.line.saturating_sub(1)) else {
            return out;
        };
        let chars: Vec<char> = text.chars().collect();
        let caret = (self.start.column.max(1) - 1).min(chars.len());
        let width = if self.end.line == self.start.line && self.end.column > self.start.column {
            self.end.column - self.start.column
        } else {
            1
        };
        // The window: up to a third of it before the caret, the rest after.
        let from = caret.saturating_sub(LINE_WINDOW / 3);
        let to = (from + LINE_WINDOW).min(chars.len());
        let (lead, trail) = (
            if from > 0 { "..." } else { "" },
            if to < chars.len() { "..." } else { "" },
        );
        let shown: String = chars[from..to].iter().collect();
        let width = width.min(to.saturating_sub(caret)).max(1);
        let gutter = self.start.line.to_string().len();
        let pad = " ".repeat(gutter);
        out += &format!(
            "{pad}--> {}:{}\n{pad} |\n{} | {lead}{shown}{trail}\n{pad} | {}{}\n",
            self.start.line,
            self.start.column,
            self.start.line,
            " ".repeat(lead.len() + caret - from),
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
    /// Positions of the call lie outside the range the kernels represent exactly.
    #[error("{0}")]
    Positions(String),
    /// The spec needs a different entry point (MLA vs. per-head KV).
    #[error("{0}")]
    WrongEntryPoint(&'static str),
    /// The backward pass cannot be built for the spec (see [`crate::modifier::grad`]).
    #[error("{0}")]
    Gradient(String),
    /// A learnable tensor (a parameter or the sinks) is missing, unexpected or misshapen.
    #[error("{0}")]
    Learned(String),
}
