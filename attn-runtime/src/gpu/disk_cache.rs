//! A disk cache of compiled PTX, so that a second process does not run LLVM again.
//!
//! **Where.** `ATTN_CACHE_DIR` when set, else the platform's cache directory (`$XDG_CACHE_HOME`
//! or `~/.cache` on Linux, `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on Windows) under
//! `attn`. The cache owns one subfolder of that directory, [`SUBFOLDER`], marked by a
//! `CACHEDIR.TAG` it writes; it reads, lists and removes nothing outside it. A variable pointed
//! at the wrong place (a checkpoint, a home directory) loses no file.
//!
//! **Entries.** One JSON file per kernel and target, named `<32 hex digits>.json` by a hash of
//! the PTX compiler's version ([`compiler_version`]), the target and the kernel's GPU IR text.
//! A file holds what it was made from and a hash of its PTX, and a lookup checks all of it: the
//! format, the compiler, the target, the IR, the hash, and that the PTX declares this kernel's
//! entry point for this target. A stale, foreign or damaged file is a miss, never an error or a
//! wrong kernel. `clear` removes only files that parse as entries; anything else found there is
//! left and counted. Files are written to a temporary name and renamed, so a reader never sees
//! half of one.
//!
//! **Trust.** The hash finds damage and edits that did not recompute it; it is not a signature,
//! and anyone who can write the folder can make an entry that passes. So on Unix the folder is
//! created readable and writable by its owner only, and a folder (or entry) that another user
//! owns, or that its group or others may write, is not used at all: lookups miss, stores fail,
//! and [`DiskCache::check_trusted`] says why.

use crate::error::RuntimeError;
use codegen::gpu::ir::Kernel;
use codegen::gpu::ir::target::{Arch, compiler_version, text_hash};
use std::path::{Path, PathBuf};

/// Largest cache file read back: no kernel's PTX comes near it.
const MAX_ENTRY_BYTES: u64 = 256 << 20;

/// The entry format; files of another are misses.
const FORMAT: i64 = 2;

/// The subfolder of the cache directory that holds the entries.
pub const SUBFOLDER: &str = "attn-kernels";

/// The marker the subfolder carries (the Cache Directory Tagging convention, which backup
/// tools honour).
const MARKER: &str = "CACHEDIR.TAG";

const MARKER_TEXT: &str = "Signature: 8a477f597d28d172789f06886806bc55\n\
# This directory holds PTX compiled by attn. `attnc cache clear` empties it.\n\
# For information about cache directory tags, see https://bford.info/cachedir/\n";

/// A directory of cached PTX.
#[derive(Clone, Debug)]
pub struct DiskCache {
    /// The subfolder the entries are in.
    dir: PathBuf,
    compiler: String,
}

/// What `attnc cache list` shows of an entry. Its fields come from a file on disk: print them
/// escaped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheEntry {
    /// The file's key (its name without `.json`).
    pub key: String,
    /// The kernel's entry point.
    pub kernel: String,
    /// The target (`sm_90`).
    pub target: String,
    /// The PTX compiler that made it.
    pub compiler: String,
    /// The spec it was compiled for, when the compiling call knew it.
    pub spec: Option<String>,
    /// Bytes on disk.
    pub bytes: u64,
}

/// What [`DiskCache::clear`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cleared {
    /// Entries removed.
    pub removed: usize,
    /// Files and folders in the cache's subfolder that are not entries, left where they are.
    pub kept: usize,
}

/// An entry file's fields, when it is a well-formed entry of this format.
struct Entry {
    kernel: String,
    target: String,
    compiler: String,
    spec: Option<String>,
    ir: String,
    ptx: String,
}

impl Entry {
    /// Parses an entry; `None` for anything that is not one (another format, a missing or
    /// mistyped field, PTX that does not match its hash or name its kernel and target).
    fn parse(bytes: &[u8]) -> Option<Entry> {
        let json: serde_json::Value = serde_json::from_slice(bytes).ok()?;
        let text = |name: &str| json.get(name)?.as_str().map(str::to_string);
        if json.get("format")?.as_i64()? != FORMAT {
            return None;
        }
        let entry = Entry {
            kernel: text("kernel")?,
            target: text("target")?,
            compiler: text("compiler")?,
            spec: match json.get("spec")? {
                serde_json::Value::Null => None,
                other => Some(other.as_str()?.to_string()),
            },
            ir: text("ir")?,
            ptx: text("ptx")?,
        };
        let hash_matches = text("ptx_hash")? == text_hash(&entry.ptx);
        (hash_matches && declares(&entry.ptx, &entry.kernel, &entry.target)).then_some(entry)
    }
}

/// Whether `ptx` is for `target` and declares the entry point `kernel`.
fn declares(ptx: &str, kernel: &str, target: &str) -> bool {
    let for_target = ptx
        .lines()
        .filter_map(|l| l.trim().strip_prefix(".target"))
        .any(|rest| rest.split([' ', '\t', ',']).find(|w| !w.is_empty()) == Some(target));
    let entry = format!(".entry {kernel}(");
    for_target && ptx.contains(&entry)
}

/// Whether `name` is an entry's file name: 32 lowercase hex digits and `.json`.
fn is_entry_name(name: &str) -> bool {
    name.strip_suffix(".json").is_some_and(|key| {
        key.len() == 32 && key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

impl DiskCache {
    /// The cache under `dir` (entries in `dir/attn-kernels`), for this build's PTX compiler.
    pub fn at(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache {
            dir: dir.into().join(SUBFOLDER),
            compiler: compiler_version(),
        }
    }

    /// The cache under `ATTN_CACHE_DIR`, else under the platform's cache directory; `None`
    /// when neither is known (no home directory).
    pub fn default_location() -> Option<DiskCache> {
        if let Some(dir) = codegen::settings::cache_dir() {
            return Some(DiskCache::at(dir));
        }
        let env = |name| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let base = if cfg!(target_os = "windows") {
            env("LOCALAPPDATA")
        } else if cfg!(target_os = "macos") {
            env("HOME").map(|h| h.join("Library/Caches"))
        } else {
            env("XDG_CACHE_HOME").or_else(|| env("HOME").map(|h| h.join(".cache")))
        };
        base.map(|b| DiskCache::at(b.join("attn")))
    }

    /// The same cache as seen by another PTX compiler (tests of invalidation).
    pub fn with_compiler(mut self, compiler: impl Into<String>) -> DiskCache {
        self.compiler = compiler.into();
        self
    }

    /// The folder the entries are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, ir: &str, arch: Arch) -> PathBuf {
        let key = text_hash(&format!("{}\n{}\n{ir}", self.compiler, arch.name()));
        self.dir.join(format!("{key}.json"))
    }

    /// Refuses a cache folder that others could have written (see the module docs); a folder
    /// not made yet is fine.
    pub fn check_trusted(&self) -> Result<(), RuntimeError> {
        match std::fs::symlink_metadata(&self.dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(self.error(e.to_string())),
            Ok(meta) if !meta.is_dir() => Err(self.error(
                "is not a directory (a file or symlink is in the cache's place); remove it or \
                 set ATTN_CACHE_DIR elsewhere"
                    .to_string(),
            )),
            Ok(meta) => untrusted(&meta).map_or(Ok(()), |why| {
                Err(self.error(format!(
                    "{why}, so the PTX in it could be anyone's; it is not used (make it yours \
                     and writable by you alone, or set ATTN_CACHE_DIR elsewhere)"
                )))
            }),
        }
    }

    fn error(&self, message: String) -> RuntimeError {
        RuntimeError::Data(format!("kernel cache {}: {message}", self.dir.display()))
    }

    /// The cached PTX of `kernel` for `arch`, when a trusted file made by this compiler from
    /// this kernel is there.
    pub fn get(&self, kernel: &Kernel, arch: Arch) -> Option<String> {
        self.check_trusted().ok()?;
        let ir = kernel.to_string();
        let entry = read_entry(&self.path(&ir, arch))?;
        let same = entry.compiler == self.compiler
            && entry.target == arch.name()
            && entry.kernel == kernel.name
            && entry.ir == ir;
        same.then_some(entry.ptx)
    }

    /// Stores the PTX of `kernel` for `arch` (`spec`: what it was compiled for, when known).
    pub fn put(
        &self,
        kernel: &Kernel,
        arch: Arch,
        ptx: &str,
        spec: Option<&str>,
    ) -> Result<(), RuntimeError> {
        let io = |e: std::io::Error| self.error(e.to_string());
        self.create()?;
        let ir = kernel.to_string();
        let path = self.path(&ir, arch);
        let entry = serde_json::json!({
            "format": FORMAT,
            "kernel": kernel.name,
            "target": arch.name(),
            "compiler": self.compiler,
            "spec": spec,
            "ir": ir,
            "ptx": ptx,
            "ptx_hash": text_hash(ptx),
        });
        let temp = path.with_extension(format!("tmp{}", std::process::id()));
        write_private(&temp, entry.to_string().as_bytes()).map_err(io)?;
        std::fs::rename(&temp, &path).map_err(|e| {
            std::fs::remove_file(&temp).ok();
            io(e)
        })
    }

    /// Makes the subfolder (owner-only on Unix) and its marker, and checks it is trusted.
    fn create(&self) -> Result<(), RuntimeError> {
        let io = |e: std::io::Error| self.error(e.to_string());
        if let Some(parent) = self.dir.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        let mut builder = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        match builder.create(&self.dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(io(e)),
            _ => {}
        }
        self.check_trusted()?;
        let marker = self.dir.join(MARKER);
        if !marker.exists() {
            write_private(&marker, MARKER_TEXT.as_bytes()).map_err(io)?;
        }
        Ok(())
    }

    /// Every entry, by kernel and target. A missing folder is an empty cache; an untrusted
    /// one is an error.
    pub fn list(&self) -> Result<Vec<CacheEntry>, RuntimeError> {
        self.check_trusted()?;
        let mut out = Vec::new();
        for (path, key) in self.entry_files()?.0 {
            let Some(entry) = read_entry(&path) else {
                continue;
            };
            out.push(CacheEntry {
                key,
                kernel: entry.kernel,
                target: entry.target,
                compiler: entry.compiler,
                spec: entry.spec,
                bytes: std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0),
            });
        }
        out.sort_by(|a, b| (&a.kernel, &a.target, &a.key).cmp(&(&b.kernel, &b.target, &b.key)));
        Ok(out)
    }

    /// Removes every entry: only files named and formed as entries; everything else in the
    /// subfolder is left and counted. Goes through every entry even when one cannot be
    /// removed, then reports the first failure.
    pub fn clear(&self) -> Result<Cleared, RuntimeError> {
        self.check_trusted()?;
        let (files, mut kept) = self.entry_files()?;
        let mut removed = 0;
        let mut failed = None;
        for (path, _) in files {
            if read_entry(&path).is_none() {
                kept += 1;
                continue;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => removed += 1,
                Err(e) => {
                    kept += 1;
                    failed.get_or_insert_with(|| {
                        RuntimeError::Data(format!("kernel cache {}: {e}", path.display()))
                    });
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(Cleared { removed, kept }),
        }
    }

    /// The regular files of the subfolder named as entries (path and key), and how many other
    /// things it holds besides the marker. A missing folder holds nothing.
    fn entry_files(&self) -> Result<(Vec<(PathBuf, String)>, usize), RuntimeError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
            Err(e) => return Err(self.error(e.to_string())),
        };
        let mut files = Vec::new();
        let mut others = 0;
        for entry in entries {
            let entry = entry.map_err(|e| self.error(e.to_string()))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            // The file type of the entry itself: a symlink is not followed.
            let regular = entry.file_type().is_ok_and(|t| t.is_file());
            if regular && is_entry_name(&name) {
                let key = name.trim_end_matches(".json").to_string();
                files.push((entry.path(), key));
            } else if name != MARKER {
                others += 1;
            }
        }
        Ok((files, others))
    }
}

/// Writes `bytes` to a new file at `path` that only its owner may read or write (on Unix),
/// whatever the umask.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)?.write_all(bytes)
}

/// Why a file or folder with `meta` may have been written by someone else; `None` when only
/// its owner, this process's user, can write it.
#[cfg(unix)]
fn untrusted(meta: &std::fs::Metadata) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Some(format!(
            "it belongs to user {}, not to you ({me})",
            meta.uid()
        ));
    }
    let mode = meta.mode();
    (mode & 0o022 != 0)
        .then(|| format!("its group or others may write it (mode {:o})", mode & 0o777))
}

#[cfg(not(unix))]
fn untrusted(_: &std::fs::Metadata) -> Option<String> {
    None
}

/// An entry file, when it is a regular, trusted file of at most [`MAX_ENTRY_BYTES`] that parses
/// as an entry.
fn read_entry(path: &Path) -> Option<Entry> {
    let meta = std::fs::symlink_metadata(path).ok()?;
    if !meta.is_file() || untrusted(&meta).is_some() {
        return None;
    }
    let bytes = crate::files::read_bounded(path, MAX_ENTRY_BYTES, "a cache entry").ok()?;
    Entry::parse(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(name: &str) -> Kernel {
        Kernel {
            name: name.into(),
            params: Vec::new(),
            regs: Vec::new(),
            shared_bytes: 0,
            threads: 32,
            ctas_per_sm: 1,
            body: Vec::new(),
        }
    }

    /// PTX that declares `name` for `arch`, as the cache checks.
    fn ptx(name: &str, arch: Arch) -> String {
        format!(
            ".version 8.0\n.target {}\n.visible .entry {name}(\n)\n{{\n}}\n",
            arch.name()
        )
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("attn-cache-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        dir
    }

    #[test]
    fn stored_ptx_comes_back_for_the_same_kernel_target_and_compiler_only() {
        let dir = temp_dir("roundtrip");
        let cache = DiskCache::at(&dir);
        let (a, b) = (kernel("a"), kernel("b"));
        assert_eq!(cache.get(&a, Arch::Sm90), None);
        let text = ptx("a", Arch::Sm90);
        cache
            .put(&a, Arch::Sm90, &text, Some("heads = 1, head_dim = 8"))
            .unwrap();
        assert_eq!(cache.get(&a, Arch::Sm90), Some(text));
        // Another kernel, another target, another compiler: misses.
        assert_eq!(cache.get(&b, Arch::Sm90), None);
        assert_eq!(cache.get(&a, Arch::Sm80), None);
        let newer = DiskCache::at(&dir).with_compiler("attn-codegen 9.9.9");
        assert_eq!(newer.get(&a, Arch::Sm90), None);
        let listed = cache.list().unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(
            (listed[0].kernel.as_str(), listed[0].target.as_str()),
            ("a", "sm_90")
        );
        assert_eq!(listed[0].spec.as_deref(), Some("heads = 1, head_dim = 8"));
        assert!(dir.join(SUBFOLDER).join(MARKER).is_file());
        let cleared = cache.clear().unwrap();
        assert_eq!(
            cleared,
            Cleared {
                removed: 1,
                kept: 0
            }
        );
        assert_eq!(cache.get(&a, Arch::Sm90), None);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn damaged_or_foreign_files_are_misses() {
        let dir = temp_dir("damaged");
        let cache = DiskCache::at(&dir);
        let a = kernel("a");
        cache
            .put(&a, Arch::Sm80, &ptx("a", Arch::Sm80), None)
            .unwrap();
        let path = cache.path(&a.to_string(), Arch::Sm80);
        for damage in ["not json", "{\"format\": 2}", "[1, 2, 3]", ""] {
            std::fs::write(&path, damage).unwrap();
            assert_eq!(cache.get(&a, Arch::Sm80), None, "{damage:?}");
        }
        let entry = |ir: String, ptx: String, hash: String| {
            serde_json::json!({
                "format": FORMAT, "kernel": "a", "target": "sm_80",
                "compiler": compiler_version(), "spec": null, "ir": ir, "ptx": ptx,
                "ptx_hash": hash,
            })
            .to_string()
        };
        let good = ptx("a", Arch::Sm80);
        // A file that names another kernel's IR under this key is not served.
        std::fs::write(
            &path,
            entry("something else".into(), good.clone(), text_hash(&good)),
        )
        .unwrap();
        assert_eq!(cache.get(&a, Arch::Sm80), None);
        // PTX that is not what its hash says: edited after it was stored.
        let edited = good.replace("{", "{ trap;");
        std::fs::write(&path, entry(a.to_string(), edited, text_hash(&good))).unwrap();
        assert_eq!(cache.get(&a, Arch::Sm80), None);
        // Another kernel's PTX, hash and all, under this kernel's key.
        let foreign = ptx("b", Arch::Sm80);
        let hash = text_hash(&foreign);
        std::fs::write(&path, entry(a.to_string(), foreign, hash)).unwrap();
        assert_eq!(cache.get(&a, Arch::Sm80), None);
        // PTX for another target.
        let other = ptx("a", Arch::Sm90);
        let hash = text_hash(&other);
        std::fs::write(&path, entry(a.to_string(), other, hash)).unwrap();
        assert_eq!(cache.get(&a, Arch::Sm80), None);
        // The whole entry, as stored: served.
        std::fs::write(&path, entry(a.to_string(), good.clone(), text_hash(&good))).unwrap();
        assert_eq!(cache.get(&a, Arch::Sm80), Some(good));
        // A missing directory is an empty cache.
        assert!(
            DiskCache::at(dir.join("nowhere"))
                .list()
                .unwrap()
                .is_empty()
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn entry_names_are_32_hex_digits_and_json() {
        assert!(is_entry_name("0123456789abcdef0123456789abcdef.json"));
        for name in [
            "config.json",
            "0123456789abcdef0123456789abcdef.json.tmp1",
            "0123456789ABCDEF0123456789abcdef.json",
            "0123456789abcdef0123456789abcde.json",
            "0123456789abcdef0123456789abcdef",
        ] {
            assert!(!is_entry_name(name), "{name}");
        }
    }

    #[test]
    fn ptx_declares_its_kernel_and_target() {
        let text = ptx("attn_fwd", Arch::Sm90a);
        assert!(declares(&text, "attn_fwd", "sm_90a"));
        assert!(!declares(&text, "attn_fwd", "sm_90"));
        assert!(!declares(&text, "attn_fw", "sm_90a"));
        assert!(!declares("", "attn_fwd", "sm_90a"));
    }

    #[cfg(unix)]
    #[test]
    fn a_folder_others_may_write_is_not_used() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("shared");
        let cache = DiskCache::at(&dir);
        let a = kernel("a");
        cache
            .put(&a, Arch::Sm80, &ptx("a", Arch::Sm80), None)
            .unwrap();
        assert!(cache.get(&a, Arch::Sm80).is_some());
        let sub = dir.join(SUBFOLDER);
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(cache.get(&a, Arch::Sm80), None);
        let e = cache.check_trusted().unwrap_err().to_string();
        assert!(e.contains("group or others may write it (mode 777)"), "{e}");
        assert!(
            cache
                .put(&a, Arch::Sm80, &ptx("a", Arch::Sm80), None)
                .is_err()
        );
        assert!(cache.list().is_err() && cache.clear().is_err());
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o700)).unwrap();
        // An entry others may write is a miss.
        let path = cache.path(&a.to_string(), Arch::Sm80);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(cache.get(&a, Arch::Sm80), None);
        std::fs::remove_dir_all(&dir).ok();
    }
}
