//! The SPEC argument: a spec string, or `@FILE`.

use attn::AttentionSpec;

/// Reads and parses a SPEC argument. On failure, returns the message to print: the rendered
/// parse errors with the offending source line, or why the file could not be read.
pub fn load(arg: &str) -> Result<(AttentionSpec, String), String> {
    let (source, origin) = match arg.strip_prefix('@') {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("error: cannot read spec file `{path}`: {e}"))?;
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
