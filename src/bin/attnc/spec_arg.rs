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

/// Reads a text file (a spec, a model's TOML) of at most `limit` bytes, without reading more than one byte past it (the
/// path may name a device or pipe that never ends).
pub fn read_bounded(path: impl AsRef<std::path::Path>, limit: usize) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    file.take(limit as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() > limit {
        return Err(format!("it is longer than {limit} bytes, the most allowed"));
    }
    String::from_utf8(bytes).map_err(|_| "it is not UTF-8 text".to_string())
}
