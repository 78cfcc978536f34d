//! Environment settings (`ATTN_*` variables): each takes a few exact spellings, and any other
//! value is an error that names it, so a mistyped setting is never silently read as off.

/// The meaning of environment setting `name`'s `value` among `choices` (unset: the first), or
/// an error that names the value and says what is allowed (`help`).
pub fn choice<T: Copy>(
    name: &str,
    value: Option<&std::ffi::OsStr>,
    choices: &[(&str, T)],
    help: &str,
) -> Result<T, String> {
    let Some(value) = value else {
        return Ok(choices[0].1);
    };
    let text = value.to_str();
    choices
        .iter()
        .find(|(spelling, _)| Some(*spelling) == text)
        .map(|(_, meaning)| *meaning)
        .ok_or_else(|| format!("{name} is `{}`: {help}", text.unwrap_or("(not UTF-8)")))
}

/// An on/off setting: unset, empty or `0` is off, `1` is on, anything else an error.
pub fn flag(name: &str, value: Option<&std::ffi::OsStr>, help: &str) -> Result<bool, String> {
    choice(name, value, &[("", false), ("0", false), ("1", true)], help)
}

/// Whether `ATTN_DUMP_ASM` asks for the machine code of each CPU kernel function on stderr.
pub fn dump_asm() -> Result<bool, String> {
    static ON: std::sync::OnceLock<Result<bool, String>> = std::sync::OnceLock::new();
    ON.get_or_init(|| dump_asm_setting(std::env::var_os("ATTN_DUMP_ASM").as_deref()))
        .clone()
}

fn dump_asm_setting(value: Option<&std::ffi::OsStr>) -> Result<bool, String> {
    flag(
        "ATTN_DUMP_ASM",
        value,
        "set it to 1 to print each CPU kernel function's machine code on stderr, or to 0 (or \
         leave it unset) for none",
    )
}

/// Whether GPU forward calls take the sm_90a kernel: `ATTN_GPU_WGMMA=1` (unset, empty or `0`:
/// off), read once per process.
pub fn gpu_wgmma() -> Result<bool, String> {
    static ON: std::sync::OnceLock<Result<bool, String>> = std::sync::OnceLock::new();
    ON.get_or_init(|| wgmma_setting(std::env::var_os("ATTN_GPU_WGMMA").as_deref()))
        .clone()
}

/// What a value of `ATTN_GPU_WGMMA` means (`None`: unset).
fn wgmma_setting(value: Option<&std::ffi::OsStr>) -> Result<bool, String> {
    flag(
        "ATTN_GPU_WGMMA",
        value,
        "set it to 1 to take the sm_90a forward kernel, or to 0 (or leave it unset) for the \
         default mma.sync kernel",
    )
}

/// Whether the `mma.sync` forward kernel runs at twelve warps per SM: `ATTN_GPU_MMA_WARPS=12`
/// (unset, empty or `8`: the default eight), read once per process.
pub fn gpu_mma_twelve_warps() -> Result<bool, String> {
    static TWELVE: std::sync::OnceLock<Result<bool, String>> = std::sync::OnceLock::new();
    TWELVE
        .get_or_init(|| mma_warps_setting(std::env::var_os("ATTN_GPU_MMA_WARPS").as_deref()))
        .clone()
}

/// What a value of `ATTN_GPU_MMA_WARPS` means (`None`: unset): whether it asks for twelve warps.
fn mma_warps_setting(value: Option<&std::ffi::OsStr>) -> Result<bool, String> {
    choice(
        "ATTN_GPU_MMA_WARPS",
        value,
        &[("", false), ("8", false), ("12", true)],
        "set it to 12 for twelve warps per SM in the mma.sync forward kernel, or to 8 (or leave \
         it unset) for the default eight",
    )
}

/// The environment variable that picks the CPU kernels' instruction set.
pub const CPU_ISA: &str = "ATTN_CPU_ISA";

/// The instruction set `ATTN_CPU_ISA` names, as written (`None`: unset); the runtime checks it
/// against the sets it has and this CPU runs.
pub fn cpu_isa() -> Option<String> {
    std::env::var(CPU_ISA).ok()
}

/// The folder `ATTN_CACHE_DIR` names for the disk cache of compiled GPU kernels (`None`: unset
/// or empty).
pub fn cache_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("ATTN_CACHE_DIR")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn only_unset_empty_8_and_12_are_mma_warps_settings() {
        assert_eq!(mma_warps_setting(None), Ok(false));
        assert_eq!(mma_warps_setting(Some(OsStr::new("8"))), Ok(false));
        assert_eq!(mma_warps_setting(Some(OsStr::new("12"))), Ok(true));
        for bad in ["16", "twelve", "1"] {
            let err = mma_warps_setting(Some(OsStr::new(bad))).unwrap_err();
            assert!(
                err.contains("ATTN_GPU_MMA_WARPS") && err.contains(bad),
                "{err}"
            );
        }
    }

    #[test]
    fn only_unset_empty_0_and_1_are_wgmma_settings() {
        assert_eq!(wgmma_setting(None), Ok(false));
        assert_eq!(wgmma_setting(Some(OsStr::new(""))), Ok(false));
        assert_eq!(wgmma_setting(Some(OsStr::new("0"))), Ok(false));
        assert_eq!(wgmma_setting(Some(OsStr::new("1"))), Ok(true));
        for bad in ["yes", "true", " 1", "2", "on"] {
            let err = wgmma_setting(Some(OsStr::new(bad))).unwrap_err();
            assert!(err.contains("ATTN_GPU_WGMMA") && err.contains(bad), "{err}");
        }
    }

    #[test]
    fn only_unset_empty_0_and_1_are_dump_asm_settings() {
        assert_eq!(dump_asm_setting(None), Ok(false));
        assert_eq!(dump_asm_setting(Some(OsStr::new(""))), Ok(false));
        assert_eq!(dump_asm_setting(Some(OsStr::new("0"))), Ok(false));
        assert_eq!(dump_asm_setting(Some(OsStr::new("1"))), Ok(true));
        for bad in ["yes", "true", " 1", "01"] {
            let e = dump_asm_setting(Some(OsStr::new(bad))).unwrap_err();
            assert!(
                e.starts_with(&format!("ATTN_DUMP_ASM is `{bad}`: set it to 1")),
                "{e}"
            );
        }
    }
}
