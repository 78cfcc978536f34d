//! A disk cache of compiled PTX, so that a second process does not run LLVM again.
//!
//! One JSON file per kernel and target, named by a hash of the PTX compiler's version
//! ([`compiler_version`]), the target and the kernel's GPU IR text (which the normalized spec
//! and the kernel's kind determine). A file holds what it was made from, and a lookup checks
//! it: a stale, foreign or damaged file is a miss, never an error or a wrong kernel. Files are
//! written to a temporary name and renamed, so a reader never sees half of one.
//!
//! Where: `ATTN_CACHE_DIR` when set, else the platform's cache directory (`$XDG_CACHE_HOME` or
//! `~/.cache` on Linux, `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on Windows) under
//! `attn/kernels`.

use crate::error::RuntimeError;
use codegen::gpu::ir::Kernel;
use codegen::gpu::target::{Arch, compiler_version, text_hash};
use std::path::{Path, PathBuf};

/// Largest cache file read back: no kernel's PTX comes near it.
const MAX_ENTRY_BYTES: u64 = 256 << 20;

/// The entry format; files of another are misses.
const FORMAT: i64 = 1;

/// A directory of cached PTX.
#[derive(Clone, Debug)]
pub struct DiskCache {
    dir: PathBuf,
    compiler: String,
}

/// What `attnc cache list` shows of an entry.
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

impl DiskCache {
    /// The cache at `dir`, for this build's PTX compiler.
    pub fn at(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache {
            dir: dir.into(),
            compiler: compiler_version(),
        }
    }

    /// The cache at `ATTN_CACHE_DIR`, else under the platform's cache directory; `None` when
    /// neither is known (no home directory).
    pub fn default_location() -> Option<DiskCache> {
        if let Some(dir) = std::env::var_os("ATTN_CACHE_DIR").filter(|d| !d.is_empty()) {
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
        base.map(|b| DiskCache::at(b.join("attn").join("kernels")))
    }

    /// The same cache as seen by another PTX compiler (tests of invalidation).
    pub fn with_compiler(mut self, compiler: impl Into<String>) -> DiskCache {
        self.compiler = compiler.into();
        self
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, ir: &str, arch: Arch) -> PathBuf {
        let key = text_hash(&format!("{}\n{}\n{ir}", self.compiler, arch.name()));
        self.dir.join(format!("{key}.json"))
    }

    /// The cached PTX of `kernel` for `arch`, when a file made by this compiler from this
    /// kernel is there.
    pub fn get(&self, kernel: &Kernel, arch: Arch) -> Option<String> {
        let ir = kernel.to_string();
        let entry = read_entry(&self.path(&ir, arch))?;
        let field = |name: &str| entry.get(name).and_then(|v| v.as_str());
        let same = entry.get("format").and_then(|v| v.as_i64()) == Some(FORMAT)
            && field("compiler") == Some(self.compiler.as_str())
            && field("target") == Some(arch.name())
            && field("ir") == Some(ir.as_str());
        same.then(|| field("ptx").map(str::to_string)).flatten()
    }

    /// Stores the PTX of `kernel` for `arch` (`spec`: what it was compiled for, when known).
    pub fn put(
        &self,
        kernel: &Kernel,
        arch: Arch,
        ptx: &str,
        spec: Option<&str>,
    ) -> Result<(), RuntimeError> {
        let io = |e: std::io::Error| {
            RuntimeError::Data(format!("kernel cache {}: {e}", self.dir.display()))
        };
        std::fs::create_dir_all(&self.dir).map_err(io)?;
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
        });
        let temp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&temp, entry.to_string()).map_err(io)?;
        std::fs::rename(&temp, &path).map_err(|e| {
            std::fs::remove_file(&temp).ok();
            io(e)
        })
    }

    /// Every entry, by kernel and target. A missing directory is an empty cache.
    pub fn list(&self) -> Result<Vec<CacheEntry>, RuntimeError> {
        let mut out = Vec::new();
        for path in self.files()? {
            let Some(entry) = read_entry(&path) else {
                continue;
            };
            let field = |name: &str| {
                entry
                    .get(name)
                    .and_then(|v| v.as_str())
                    .unwrap_or("?")
                    .to_string()
            };
            out.push(CacheEntry {
                key: path
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                kernel: field("kernel"),
                target: field("target"),
                compiler: field("compiler"),
                spec: entry
                    .get("spec")
                    .and_then(|v| v.as_str())
                    .map(str::to_string),
                bytes: std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0),
            });
        }
        out.sort_by(|a, b| (&a.kernel, &a.target, &a.key).cmp(&(&b.kernel, &b.target, &b.key)));
        Ok(out)
    }

    /// Removes every entry; returns how many.
    pub fn clear(&self) -> Result<usize, RuntimeError> {
        let files = self.files()?;
        for path in &files {
            std::fs::remove_file(path)
                .map_err(|e| RuntimeError::Data(format!("kernel cache {}: {e}", path.display())))?;
        }
        Ok(files.len())
    }

    /// The entry files (`*.json`) of the directory.
    fn files(&self) -> Result<Vec<PathBuf>, RuntimeError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(RuntimeError::Data(format!(
                    "kernel cache {}: {e}",
                    self.dir.display()
                )));
            }
        };
        Ok(entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect())
    }
}

/// An entry file as JSON; `None` when it is missing, too large or not JSON.
fn read_entry(path: &Path) -> Option<serde_json::Value> {
    use std::io::Read;
    let file = std::fs::File::open(path).ok()?;
    let mut bytes = Vec::new();
    file.take(MAX_ENTRY_BYTES + 1)
        .read_to_end(&mut bytes)
        .ok()?;
    if bytes.len() as u64 > MAX_ENTRY_BYTES {
        return None;
    }
    serde_json::from_slice(&bytes).ok()
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
        cache
            .put(&a, Arch::Sm90, "ptx of a", Some("heads = 1, head_dim = 8"))
            .unwrap();
        assert_eq!(cache.get(&a, Arch::Sm90).as_deref(), Some("ptx of a"));
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
        assert_eq!(cache.clear().unwrap(), 1);
        assert_eq!(cache.get(&a, Arch::Sm90), None);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn damaged_or_foreign_files_are_misses() {
        let dir = temp_dir("damaged");
        let cache = DiskCache::at(&dir);
        let a = kernel("a");
        cache.put(&a, Arch::Sm80, "ptx", None).unwrap();
        let path = cache.path(&a.to_string(), Arch::Sm80);
        for damage in ["not json", "{\"format\": 1}", "[1, 2, 3]", ""] {
            std::fs::write(&path, damage).unwrap();
            assert_eq!(cache.get(&a, Arch::Sm80), None, "{damage:?}");
        }
        // A file that names another kernel's IR under this key is not served either.
        let mut entry: serde_json::Value = serde_json::json!({
            "format": 1, "kernel": "a", "target": "sm_80", "compiler": compiler_version(),
            "ir": "something else", "ptx": "wrong",
        });
        std::fs::write(&path, entry.to_string()).unwrap();
        assert_eq!(cache.get(&a, Arch::Sm80), None);
        entry["ir"] = serde_json::Value::String(a.to_string());
        std::fs::write(&path, entry.to_string()).unwrap();
        assert_eq!(cache.get(&a, Arch::Sm80).as_deref(), Some("wrong"));
        // A missing directory is an empty cache.
        assert!(
            DiskCache::at(dir.join("nowhere"))
                .list()
                .unwrap()
                .is_empty()
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
