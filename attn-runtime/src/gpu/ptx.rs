//! Where a kernel's PTX comes from, in order: embedded in the program at cargo time
//! (`#[attention(..., targets = [..])]` with the `aot` feature registers its kernels here), the
//! disk cache ([`super::disk_cache`]), or compiled now through LLVM (the `llvm` feature), which
//! then fills the disk cache. A build without `llvm` runs what is embedded or cached, and says
//! plainly what to do for anything else.

use super::disk_cache::DiskCache;
use crate::error::RuntimeError;
use codegen::gpu::ir::Kernel;
use codegen::gpu::ir::target::{Arch, kernel_hash};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

/// Where a kernel's PTX came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PtxOrigin {
    /// Compiled at cargo time and embedded in the program.
    Embedded,
    /// Read from the disk cache.
    DiskCache,
    /// Compiled in this process (and stored in the disk cache).
    Compiled,
}

impl fmt::Display for PtxOrigin {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(match self {
            PtxOrigin::Embedded => "embedded",
            PtxOrigin::DiskCache => "disk cache",
            PtxOrigin::Compiled => "compiled",
        })
    }
}

/// A kernel's PTX and where it came from.
#[derive(Clone, Debug)]
pub struct Ptx {
    /// The PTX assembly.
    pub text: Arc<str>,
    /// Where it came from.
    pub origin: PtxOrigin,
}

/// A kernel compiled at cargo time, as the macro embeds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddedKernel {
    /// What the kernel is for (`forward`, `decode`, `backward dq`, ...).
    pub role: &'static str,
    /// Its entry point.
    pub name: &'static str,
    /// [`kernel_hash`] of its GPU IR when it was compiled.
    pub hash: &'static str,
    /// The target (`sm_90`).
    pub target: &'static str,
    /// The PTX.
    pub ptx: &'static str,
    /// Its launch record as JSON (parameters, threads, shared bytes, CTAs per SM).
    pub launch: &'static str,
}

type Registry = Mutex<HashMap<(String, Arch), &'static EmbeddedKernel>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Makes embedded kernels available to every backend of the process (the macro's generated
/// code calls it once per annotated type). Entries for unknown targets are ignored.
pub fn register_embedded(kernels: &'static [EmbeddedKernel]) {
    let mut map = registry().lock().unwrap_or_else(|p| p.into_inner());
    for k in kernels {
        if let Some(arch) = Arch::from_name(k.target) {
            map.insert((k.hash.to_string(), arch), k);
        }
    }
}

/// The embedded PTX of `kernel` for `arch`, if a registered type carries it.
fn embedded(kernel: &Kernel, arch: Arch) -> Option<&'static EmbeddedKernel> {
    let map = registry().lock().unwrap_or_else(|p| p.into_inner());
    map.get(&(kernel_hash(kernel), arch))
        .copied()
        .filter(|k| k.name == kernel.name)
}

/// The PTX of `kernel` for `arch`: embedded, from the disk cache, or compiled (see the module
/// docs). `spec`, when known, is recorded with what is cached.
pub fn ptx_for(kernel: &Kernel, arch: Arch, spec: Option<&str>) -> Result<Ptx, RuntimeError> {
    if let Some(k) = embedded(kernel, arch) {
        return Ok(Ptx {
            text: Arc::from(k.ptx),
            origin: PtxOrigin::Embedded,
        });
    }
    let cache = DiskCache::default_location().filter(|c| match c.check_trusted() {
        Ok(()) => true,
        Err(e) => {
            warn_untrusted_once(&e);
            false
        }
    });
    if let Some(text) = cache.as_ref().and_then(|c| c.get(kernel, arch)) {
        return Ok(Ptx {
            text: Arc::from(text),
            origin: PtxOrigin::DiskCache,
        });
    }
    compile(kernel, arch, spec, cache.as_ref())
}

/// Says once per process that the disk cache is not used, and why.
fn warn_untrusted_once(e: &RuntimeError) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| eprintln!("warning: {e}"));
}

#[cfg(feature = "llvm")]
fn compile(
    kernel: &Kernel,
    arch: Arch,
    spec: Option<&str>,
    cache: Option<&DiskCache>,
) -> Result<Ptx, RuntimeError> {
    let text = codegen::gpu::llvm::emit(kernel, arch)?.ptx;
    // A cache that cannot be written costs the next process a compile, not this call.
    if let Some(cache) = cache
        && let Err(e) = cache.put(kernel, arch, &text, spec)
    {
        warn_once(&e);
    }
    Ok(Ptx {
        text: Arc::from(text),
        origin: PtxOrigin::Compiled,
    })
}

#[cfg(feature = "llvm")]
fn warn_once(e: &RuntimeError) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| eprintln!("warning: compiled PTX is not cached: {e}"));
}

#[cfg(not(feature = "llvm"))]
fn compile(
    kernel: &Kernel,
    arch: Arch,
    _: Option<&str>,
    cache: Option<&DiskCache>,
) -> Result<Ptx, RuntimeError> {
    let cached = match cache {
        Some(c) => format!("not in the disk cache ({})", c.dir().display()),
        None => "no disk cache (set ATTN_CACHE_DIR)".to_string(),
    };
    Err(RuntimeError::NotBuilt(format!(
        "no PTX for kernel `{}` on {}: it is not embedded (declare the spec with \
         `#[attention(..., targets = [{}])]` and the `aot` feature), {cached}, and this build \
         has no PTX compiler (enable the `llvm` feature)",
        kernel.name,
        arch.name(),
        arch.name()
    )))
}
