//! Checks on the files attnc writes: never into a FIFO, device or directory, and never over one
//! of the command's own inputs.

use std::path::Path;

/// Refuses `output` (given by the option `flag`) when it exists and is not a regular file, or
/// when it is the same file as one of `inputs` (the same path, a link to it, or a hard link).
pub fn check(output: &Path, inputs: &[&Path], flag: &str) -> Result<(), String> {
    attn::runtime::files::ensure_writable_target(output).map_err(|e| format!("error: {e}"))?;
    for input in inputs {
        if same_file(output, input) {
            return Err(format!(
                "error: {flag} {} is the input {}: writing it would overwrite what is read; \
                 allowed: another file",
                output.display(),
                input.display()
            ));
        }
    }
    Ok(())
}

/// Whether `a` and `b` both exist and are one file.
fn same_file(a: &Path, b: &Path) -> bool {
    let (Ok(ma), Ok(mb)) = (std::fs::metadata(a), std::fs::metadata(b)) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        (ma.dev(), ma.ino()) == (mb.dev(), mb.ino())
    }
    #[cfg(not(unix))]
    {
        let _ = (ma, mb);
        matches!(
            (a.canonicalize(), b.canonicalize()),
            (Ok(x), Ok(y)) if x == y
        )
    }
}

/// Writes `bytes` to `path` whole ([`write_whole_with`]).
pub fn write_whole(path: &Path, bytes: &[u8]) -> Result<(), String> {
    write_whole_with(path, |temporary| {
        std::fs::write(temporary, bytes).map_err(|e| e.to_string())
    })
}

/// Makes the file `path` by `make`, which writes it at the path it is given (a temporary name
/// beside it, `.NAME.partial`); the file is flushed to disk and renamed into place, or removed
/// when anything fails (a full disk among them), so `path` is the old file or the whole new
/// one, never a part, and nothing else is left behind.
pub fn write_whole_with(
    path: &Path,
    make: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<(), String> {
    let (dir, name) = match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => (dir, name.to_string_lossy()),
        _ => {
            return Err(format!(
                "error: cannot write {}: not a file path",
                path.display()
            ));
        }
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let temporary = dir.join(format!(".{name}.partial"));
    let sync = |p: &Path| std::fs::File::open(p).and_then(|f| f.sync_all());
    let result = make(&temporary)
        .and_then(|()| sync(&temporary).map_err(|e| e.to_string()))
        .and_then(|()| std::fs::rename(&temporary, path).map_err(|e| e.to_string()))
        .and_then(|()| sync(dir).map_err(|e| e.to_string()));
    if result.is_err() {
        std::fs::remove_file(&temporary).ok();
    }
    result.map_err(|e| format!("error: cannot write {}: {e}", path.display()))
}

/// `n` and `word`, the word plural unless `n` is 1 (`1 token`, `2 tokens`).
pub fn counted(n: u64, word: &str) -> String {
    match n {
        1 => format!("1 {word}"),
        _ => format!("{n} {word}s"),
    }
}
