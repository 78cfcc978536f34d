//! The folders `attnc train` and `attnc sweep` write: recognisably theirs, by a marker file,
//! and held by one process at a time, by a lock on that marker. Files are written whole or not
//! at all (a temporary file, flushed to disk, then renamed into place), and a failed write
//! leaves no temporary file behind.
//!
//! A folder is taken only when it is missing, empty, or already marked as one of the same
//! kind: pointed at a checkpoint, a home directory or a sweep, `attnc train` writes nothing.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// What a folder holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// One training run (`attnc train --out`, or a seed of a sweep).
    Run,
    /// A sweep's results and runs (`attnc sweep --out`).
    Sweep,
}

impl Kind {
    /// The marker file's name.
    pub fn marker(self) -> &'static str {
        match self {
            Kind::Run => "attnc-run.json",
            Kind::Sweep => "attnc-sweep.json",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Kind::Run => "an attnc train run",
            Kind::Sweep => "an attnc sweep",
        }
    }

    fn command(self) -> &'static str {
        match self {
            Kind::Run => "attnc train",
            Kind::Sweep => "attnc sweep",
        }
    }

    fn other(self) -> Kind {
        match self {
            Kind::Run => Kind::Sweep,
            Kind::Sweep => Kind::Run,
        }
    }
}

/// A folder of ours, locked for as long as this value lives.
pub struct Folder {
    path: PathBuf,
    /// The marker, open and locked: the lock goes with the process (a kill releases it).
    _lock: File,
}

impl Folder {
    /// Takes `path` for writing a `kind` folder: made when missing, or empty, or one of ours of
    /// that kind (not held by another process). `flag` names the option in errors.
    pub fn claim(path: &Path, kind: Kind, flag: &str) -> Result<Folder, String> {
        let shown = path.display();
        match std::fs::metadata(path) {
            Ok(meta) if !meta.is_dir() => {
                return Err(format!(
                    "error: {flag} {shown} is not a folder; allowed: a new folder, an empty one, \
                     or one {} wrote",
                    kind.command()
                ));
            }
            Ok(_) => {}
            Err(_) => std::fs::create_dir_all(path)
                .map_err(|e| format!("error: {flag} {shown}: cannot make the folder: {e}"))?,
        }
        if !path.join(kind.marker()).exists() {
            refuse_foreign(path, kind, flag)?;
        }
        Self::lock(path, kind, flag)
    }

    /// Opens `path`, which must be a `kind` folder of ours, for writing.
    pub fn open(path: &Path, kind: Kind, flag: &str) -> Result<Folder, String> {
        if !path.join(kind.marker()).is_file() {
            let why = if path.is_dir() {
                format!(
                    "it is not {} folder (no {})",
                    kind.describe(),
                    kind.marker()
                )
            } else {
                "no such folder".to_string()
            };
            return Err(format!("error: {flag} {}: {why}", path.display()));
        }
        Self::lock(path, kind, flag)
    }

    /// Opens (making it if needed) and locks the marker, writing its text when it is new.
    fn lock(path: &Path, kind: Kind, flag: &str) -> Result<Folder, String> {
        let marker = path.join(kind.marker());
        let cannot =
            |e: std::io::Error| format!("error: {flag} {}: cannot write {e}", marker.display());
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&marker)
            .map_err(cannot)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(format!(
                    "error: {flag} {}: another {} is writing this folder now; wait for it to \
                     finish, or give another folder",
                    path.display(),
                    kind.command()
                ));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(cannot(e)),
        }
        if file.metadata().map_err(cannot)?.len() == 0 {
            let text = serde_json::json!({
                "format": 1,
                "written_by": kind.command(),
                "note": "attnc writes this folder; the lock on this file keeps two processes out",
            });
            file.write_all(format!("{text}\n").as_bytes())
                .and_then(|()| file.sync_all())
                .map_err(cannot)?;
        }
        Ok(Folder {
            path: path.to_path_buf(),
            _lock: file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `bytes` to `name` in the folder, whole or not at all.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<(), String> {
        self.write_with(name, |path| {
            std::fs::write(path, bytes).map_err(|e| e.to_string())
        })
    }

    /// Makes `name` in the folder by `make`, which writes the file at the path it is given
    /// ([`crate::outputs::write_whole_with`]).
    pub fn write_with(
        &self,
        name: &str,
        make: impl FnOnce(&Path) -> Result<(), String>,
    ) -> Result<(), String> {
        crate::outputs::write_whole_with(&self.path.join(name), make)
    }

    /// Appends `text` to `name` in the folder and flushes it to disk. A kill can leave the
    /// last line cut short: readers of such logs drop it ([`super::state::read_log`]).
    pub fn append(&self, name: &str, text: &str) -> Result<(), String> {
        let path = self.path.join(name);
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&path)
            .and_then(|mut file| {
                file.write_all(text.as_bytes())?;
                file.sync_all()
            })
            .map_err(|e| format!("error: cannot write {}: {e}", path.display()))
    }

    /// The names of the folder's entries.
    pub fn entries(&self) -> Vec<String> {
        names(&self.path)
    }

    /// Removes the file `name` from the folder, if there.
    pub fn remove(&self, name: &str) {
        std::fs::remove_file(self.path.join(name)).ok();
    }

    /// Removes the temporary files an interrupted writer left.
    pub fn remove_partials(&self) {
        for name in self.entries() {
            if is_partial(&name) {
                self.remove(&name);
            }
        }
    }
}

/// Whether `name` is a temporary of an interrupted write: ours (`.NAME.partial`), or the one
/// the safetensors crate writes beside its target before renaming it (`.tmp` and 6 letters or
/// digits, the tempfile crate's default name), which a kill in the middle leaves too.
fn is_partial(name: &str) -> bool {
    let ours = name.starts_with('.') && name.ends_with(".partial");
    let safetensors = name
        .strip_prefix(".tmp")
        .is_some_and(|rest| rest.len() == 6 && rest.chars().all(|c| c.is_ascii_alphanumeric()));
    ours || safetensors
}

/// The names in folder `path` (none when it cannot be read).
fn names(path: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(path)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The error for an unmarked folder that is not empty, which nothing of ours writes into.
fn refuse_foreign(path: &Path, kind: Kind, flag: &str) -> Result<(), String> {
    let found = names(path);
    if found.is_empty() {
        return Ok(());
    }
    let shown: Vec<&str> = found.iter().take(6).map(String::as_str).collect();
    let more = if found.len() > shown.len() {
        format!(" and {} more", found.len() - shown.len())
    } else {
        String::new()
    };
    let what = if found.iter().any(|n| n == kind.other().marker()) {
        format!("it is {} folder", kind.other().describe())
    } else if kind == Kind::Run && found.iter().any(|n| n == "state.json") {
        "it holds a run of an earlier attnc, which resuming cannot continue exactly (its \
         checkpoints lack the optimizer's state); start a new run from its weights with \
         --model FOLDER/model.toml"
            .to_string()
    } else {
        format!("it is not {} folder", kind.describe())
    };
    Err(format!(
        "error: {flag} {}: {what}, and it holds {}{more}; nothing was written. Allowed: a new \
         folder, an empty one, or one {} wrote",
        path.display(),
        shown.join(", "),
        kind.command()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("attnc-folder-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        dir
    }

    #[test]
    fn only_new_empty_or_own_folders_are_taken() {
        let dir = temp("claim");
        let run = dir.join("run");
        let folder = Folder::claim(&run, Kind::Run, "--out").unwrap();
        assert!(run.join("attnc-run.json").is_file());
        // Held: a second claim or open is refused while the first lives.
        let e = Folder::claim(&run, Kind::Run, "--out").err().unwrap();
        assert!(e.contains("another attnc train is writing"), "{e}");
        let e = Folder::open(&run, Kind::Run, "--resume").err().unwrap();
        assert!(e.contains("another attnc train"), "{e}");
        drop(folder);
        Folder::open(&run, Kind::Run, "--resume").unwrap();
        // A sweep is not a run, and the other way round.
        let e = Folder::claim(&run, Kind::Sweep, "--out").err().unwrap();
        assert!(e.contains("an attnc train run folder"), "{e}");
        // A folder of someone else's files is left alone.
        let hf = dir.join("checkpoint");
        std::fs::create_dir_all(&hf).unwrap();
        std::fs::write(hf.join("model.safetensors"), b"weights").unwrap();
        std::fs::write(hf.join("config.json"), b"{}").unwrap();
        let e = Folder::claim(&hf, Kind::Run, "--out").err().unwrap();
        assert!(
            e.contains("not an attnc train run folder")
                && e.contains("config.json, model.safetensors")
                && e.contains("nothing was written"),
            "{e}"
        );
        assert_eq!(names(&hf), ["config.json", "model.safetensors"]);
        let e = Folder::open(&hf, Kind::Run, "--resume").err().unwrap();
        assert!(e.contains("no attnc-run.json"), "{e}");
        // A file is not a folder.
        let file = hf.join("config.json");
        let e = Folder::claim(&file, Kind::Run, "--out").err().unwrap();
        assert!(e.contains("is not a folder"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn writes_are_whole_or_absent() {
        let dir = temp("write");
        let folder = Folder::claim(&dir, Kind::Run, "--out").unwrap();
        folder.write("a.txt", b"first").unwrap();
        let e = folder
            .write_with("a.txt", |path| {
                std::fs::write(path, b"half").unwrap();
                Err("no space left on device".into())
            })
            .unwrap_err();
        assert!(e.contains("a.txt") && e.contains("no space"), "{e}");
        assert_eq!(std::fs::read(dir.join("a.txt")).unwrap(), b"first");
        assert_eq!(
            names(&dir),
            ["a.txt", "attnc-run.json"],
            "no temporary left"
        );
        std::fs::write(dir.join(".b.txt.partial"), b"left by a kill").unwrap();
        std::fs::write(dir.join(".tmpVrLsoq"), b"left by a kill in safetensors").unwrap();
        std::fs::write(dir.join(".tmp-kept"), b"not a temporary of ours").unwrap();
        folder.remove_partials();
        assert_eq!(names(&dir), [".tmp-kept", "a.txt", "attnc-run.json"]);
        std::fs::remove_dir_all(&dir).ok();
    }
}
