//! `attnc cache`: the disk cache of compiled kernels listed or cleared (only the files it
//! wrote).

use attn::codegen::gpu::ir::target::compiler_version;
use attn::runtime::gpu::disk_cache::DiskCache;

/// `attnc cache`'s arguments.
#[derive(clap::Args)]
pub struct Args {
    /// What to do.
    #[arg(value_enum)]
    action: Action,
}

/// What `attnc cache` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Action {
    /// Every cached kernel: key, entry point, target, compiler, size, spec.
    List,
    /// Remove every cached kernel.
    Clear,
}

/// `attnc cache`, on the default cache (`ATTN_CACHE_DIR`, else the platform's).
pub fn command(args: Args) -> Result<(), String> {
    let cache = DiskCache::default_location().ok_or_else(|| {
        "error: no kernel cache location: set ATTN_CACHE_DIR (no home directory is known)\n"
            .to_string()
    })?;
    let err = |e: attn::runtime::RuntimeError| format!("error: {e}\n");
    match args.action {
        Action::List => {
            let entries = cache.list().map_err(err)?;
            println!(
                "kernel cache {} ({} entries)",
                cache.dir().display(),
                entries.len()
            );
            let current = compiler_version();
            for e in entries {
                let stale = if e.compiler == current {
                    ""
                } else {
                    " (another compiler)"
                };
                // Every field comes from a file: escaped, so no control character reaches the
                // terminal.
                println!(
                    "{}  {:<28} {}  {:>9} B  {}{stale}",
                    e.key,
                    e.kernel.escape_debug(),
                    e.target.escape_debug(),
                    e.bytes,
                    e.spec.as_deref().unwrap_or("-").escape_debug()
                );
            }
        }
        Action::Clear => {
            let cleared = cache.clear().map_err(err)?;
            print!(
                "removed {} kernels from {}",
                cleared.removed,
                cache.dir().display()
            );
            match cleared.kept {
                0 => println!(),
                n => println!(" (left {n} files it did not write)"),
            }
        }
    }
    Ok(())
}
