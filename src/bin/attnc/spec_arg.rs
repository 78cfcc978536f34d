//! The SPEC argument: a spec string, or `@FILE`.

use attn::AttentionSpec;

/// Reads and parses a SPEC argument. On failure, returns the message to print: the rendered
/// parse errors with the offending source line, or why the file could not be read.
pub fn load(arg: &str) -> Result<(AttentionSpec, String), String> {
    let (source, origin) = match arg.strip_prefix('@') {
        Some(path) => {
            let text = read_bounded(path, attn::dsl::MAX_SPEC_BYTES)
                .map_err(|e| format!("error: cannot read spec file `{path}`: {e}\n"))?;
            (text, format!("spec file `{path}`"))
        }
        None => (arg.to_string(), "spec".to_string()),
    };
    match attn::dsl::parse_str(&source) {
        Ok(spec) => Ok((spec, source)),
        Err(errors) => {
            let count = errors.0.len();
            let mut message = errors.render(&source);
            message += &format!(
                "{origin} rejected: {count} error{}\n",
                if count == 1 { "" } else { "s" }
            );
            Err(message)
        }
    }
}

/// Reads a text file (a spec, a model's TOML) of at most `limit` bytes: a regular file only
/// (a FIFO or device is refused, never waited on or read without end).
pub fn read_bounded(path: impl AsRef<std::path::Path>, limit: usize) -> Result<String, String> {
    let path = path.as_ref();
    attn::runtime::files::read_text(path, limit as u64, "the file").map_err(|e| match e {
        attn::runtime::RuntimeError::Io { message, .. } => message,
        other => other.to_string(),
    })
}

/// The file a SPEC argument names (`@FILE`), if any: an input no output may overwrite.
pub fn spec_file(arg: &str) -> Vec<&std::path::Path> {
    arg.strip_prefix('@')
        .map(std::path::Path::new)
        .into_iter()
        .collect()
}
