//! What a kernel needs of its GPU target, known without LLVM: the architectures PTX is made
//! for, how a launch sizes dynamic shared memory, and the identity of the PTX compiler and of
//! a kernel, which caches of compiled PTX are keyed by.

use super::Kernel;

/// GPU architectures PTX is generated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arch {
    /// Ampere (A100): `mma.sync`, `cp.async`.
    Sm80,
    /// Hopper (H100, H200).
    Sm90,
    /// Hopper with its architecture-specific instructions (`wgmma`, `setmaxnreg`): PTX for it
    /// runs on compute capability 9.0 only.
    Sm90a,
}

impl Arch {
    /// Every architecture, oldest first.
    pub const ALL: [Arch; 3] = [Arch::Sm80, Arch::Sm90, Arch::Sm90a];

    /// The name ptxas and LLVM use (`sm_80`).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm90 => "sm_90",
            Arch::Sm90a => "sm_90a",
        }
    }

    /// The architecture of a name (`sm_80`, `sm_90`).
    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The newest portable architecture a device of compute capability `major.minor` runs:
    /// PTX for an older architecture runs on newer devices (the driver compiles it for them).
    /// Never [`Arch::Sm90a`], whose PTX runs on 9.0 devices alone.
    pub fn for_capability(major: u32, minor: u32) -> Option<Arch> {
        match (major, minor) {
            (9.., _) => Some(Arch::Sm90),
            (8, _) => Some(Arch::Sm80),
            _ => None,
        }
    }
}

/// Whether a kernel uses instructions only sm_90a has (`wgmma`, `setmaxnreg`).
pub fn needs_sm90a(kernel: &Kernel) -> bool {
    use super::{Stmt, any_stmt};
    any_stmt(&kernel.body, &|s| {
        matches!(
            s,
            Stmt::Wgmma(_) | Stmt::WgmmaWait { .. } | Stmt::SetMaxNReg { .. }
        )
    })
}

/// Static shared memory per CTA is limited to 48 KiB.
pub const STATIC_SHARED_LIMIT: u32 = 48 * 1024;

/// The bytes of dynamic shared memory a launch of the kernel must ask for: its shared memory
/// when over [`STATIC_SHARED_LIMIT`] (then also set as the function's maximum dynamic shared
/// size), else 0 (a static array).
pub fn dynamic_shared_bytes(kernel: &Kernel) -> u32 {
    if kernel.shared_bytes > STATIC_SHARED_LIMIT {
        kernel.shared_bytes
    } else {
        0
    }
}

/// The PTX compiler's identity: this crate's version, the LLVM it drives, and a hash of the
/// lowering's source (so that a cache of compiled PTX misses after any change to how GPU IR
/// becomes PTX, even within one version). The same in every build of the same source, with or
/// without LLVM, so a build without the compiler can use what a build with it cached.
pub fn compiler_version() -> String {
    const LOWERING: &[u8] = include_bytes!("../llvm/mod.rs");
    const ASM: &[u8] = include_bytes!("../llvm/asm.rs");
    format!(
        "attn-codegen {} (LLVM 19 NVPTX, lowering {:016x})",
        env!("CARGO_PKG_VERSION"),
        fnv1a(ASM, fnv1a(LOWERING, FNV_OFFSET))
    )
}

/// A kernel's identity for caches of its PTX: a 128-bit hash of its GPU IR text (which the
/// spec, the plan kind and the codegen source determine), as 32 hex digits.
pub fn kernel_hash(kernel: &Kernel) -> String {
    text_hash(&kernel.to_string())
}

/// [`kernel_hash`] of a kernel's printed GPU IR.
pub fn text_hash(text: &str) -> String {
    bytes_hash(text.as_bytes())
}

/// A 128-bit hash of `bytes` as 32 hex digits, stable across builds and Rust versions (unlike
/// std's hasher): two FNV-1a passes with different offset bases. It finds changes; it is no
/// defence against someone making a collision.
pub fn bytes_hash(bytes: &[u8]) -> String {
    format!(
        "{:016x}{:016x}",
        fnv1a(bytes, FNV_OFFSET),
        fnv1a(bytes, FNV_OFFSET ^ 0x9E37_79B9_7F4A_7C15)
    )
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

const fn fnv1a(bytes: &[u8], offset: u64) -> u64 {
    let mut hash = offset;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_capabilities_and_hashes() {
        assert_eq!(Arch::from_name("sm_90"), Some(Arch::Sm90));
        assert_eq!(Arch::from_name("sm_75"), None);
        assert_eq!(Arch::for_capability(9, 0), Some(Arch::Sm90));
        assert_eq!(Arch::for_capability(8, 9), Some(Arch::Sm80));
        assert_eq!(Arch::for_capability(7, 5), None);
        let (a, b) = (text_hash("kernel a"), text_hash("kernel b"));
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
        assert_eq!(a, text_hash("kernel a"));
        assert!(compiler_version().starts_with("attn-codegen "));
    }
}
