//! Reading files a user names: regular files only, and never more bytes than a limit.
//!
//! A path may name a FIFO (opening it would wait for a writer forever), a device such as
//! `/dev/zero` (it never ends, and its metadata says it holds 0 bytes), a directory, or a
//! symlink to any of these. Every read of a user path goes through [`open_regular`]: it opens
//! without blocking, looks at what it opened (not at the path, which may change in between) and
//! refuses anything that is not a regular file. [`read_bounded`] then reads at most one byte past
//! the limit, whatever the metadata claims, so a file that grows while it is read is refused too.

use crate::error::RuntimeError;
use std::io::Read;
use std::path::Path;

/// What kind of file `meta` describes, in words, for an error.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    let kind = meta.file_type();
    if kind.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if kind.is_char_device() {
            return "a character device";
        }
        if kind.is_block_device() {
            return "a block device";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    "not a regular file"
}

fn io_error(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Io {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// Opens `path` for reading when it is a regular file (symlinks followed); anything else (a
/// directory, FIFO, device or socket) is an error that says what it is. Never blocks.
pub fn open_regular(path: &Path) -> Result<std::fs::File, RuntimeError> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // A FIFO opened for reading waits for a writer unless opened non-blocking; regular
        // files ignore the flag.
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options
        .open(path)
        .map_err(|e| io_error(path, e.to_string()))?;
    let meta = file.metadata().map_err(|e| io_error(path, e.to_string()))?;
    if !meta.is_file() {
        return Err(io_error(
            path,
            format!("is {}; only regular files are read", kind_of(&meta)),
        ));
    }
    Ok(file)
}

/// Refuses `path` when it exists and is not a regular file (symlinks followed): the check for a
/// path about to be written, so that output never goes into a FIFO, a device or a directory.
pub fn ensure_writable_target(path: &Path) -> Result<(), RuntimeError> {
    match std::fs::metadata(path) {
        Ok(meta) if !meta.is_file() => Err(io_error(
            path,
            format!("is {}; only regular files are written", kind_of(&meta)),
        )),
        _ => Ok(()),
    }
}

/// The bytes of the regular file `path`, when it holds at most `limit` of them; `what` names
/// the file in the error (`"tokenizer.json"`, `"a spec file"`).
pub fn read_bounded(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>, RuntimeError> {
    let file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| io_error(path, e.to_string()))?;
    if bytes.len() as u64 > limit {
        return Err(io_error(
            path,
            format!("{what} is longer than {limit} bytes, the most allowed"),
        ));
    }
    Ok(bytes)
}

/// [`read_bounded`] for UTF-8 text.
pub fn read_text(path: &Path, limit: u64, what: &str) -> Result<String, RuntimeError> {
    String::from_utf8(read_bounded(path, limit, what)?)
        .map_err(|e| io_error(path, format!("{what} is not UTF-8 text: {e}")))
}

/// Largest JSON file of a checkpoint read (`config.json`, the shard index): real ones are a few
/// KiB to a few MiB.
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("attn-files-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn regular_files_within_the_limit_are_read_whole() {
        let dir = temp_dir("regular");
        let path = dir.join("a.txt");
        std::fs::write(&path, "hello").unwrap();
        assert_eq!(read_text(&path, 5, "a file").unwrap(), "hello");
        let long = read_text(&path, 4, "a file").unwrap_err().to_string();
        assert!(long.contains("longer than 4 bytes"), "{long}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn directories_are_refused_by_kind() {
        let dir = temp_dir("directory");
        let e = read_bounded(&dir, 10, "a file").unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = ensure_writable_target(&dir).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        assert!(ensure_writable_target(&dir.join("new")).is_ok());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[cfg(unix)]
    #[test]
    fn devices_fifos_and_symlinks_to_them_are_refused_without_blocking() {
        let dir = temp_dir("special");
        let zero = dir.join("zero.json");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_bounded(&zero, 1 << 30, "a file")
            .unwrap_err()
            .to_string();
        assert!(e.contains("character device"), "{e}");
        let fifo = dir.join("pipe");
        let status = std::process::Command::new("mkfifo").arg(&fifo).status();
        if status.is_ok_and(|s| s.success()) {
            // Would wait for a writer forever if opened blocking.
            let e = read_bounded(&fifo, 10, "a file").unwrap_err().to_string();
            assert!(e.contains("FIFO"), "{e}");
            let e = ensure_writable_target(&fifo).unwrap_err().to_string();
            assert!(e.contains("FIFO"), "{e}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
