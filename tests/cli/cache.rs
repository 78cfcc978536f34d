//! `attnc cache`: the kernel cache serves a second process; list and clear.

use crate::{attnc_with_cache, stderr, stdout, temp};

#[test]
fn the_kernel_cache_serves_a_second_process() {
    let cache = temp("kernel-cache");
    std::fs::remove_dir_all(&cache).ok();
    let list = attnc_with_cache(&["cache", "list"], &cache);
    assert_eq!(list.status.code(), Some(0), "{}", stderr(&list));
    assert!(stdout(&list).contains("(0 entries)"), "{}", stdout(&list));
    let spec = "heads = 4, head_dim = 64, mask = causal";
    let out = temp("cached.ptx");
    let emit = || {
        attnc_with_cache(
            &[
                "emit",
                spec,
                "--target",
                "sm_80",
                "-o",
                out.to_str().unwrap(),
            ],
            &cache,
        )
    };
    let first = emit();
    if !cfg!(feature = "llvm") {
        // Nothing cached and no compiler: a clear error, exit 2.
        assert_eq!(first.status.code(), Some(2));
        assert!(
            stderr(&first).contains("`llvm` feature") && !stderr(&first).contains("device:"),
            "{}",
            stderr(&first)
        );
        return;
    }
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    assert!(
        stderr(&first).contains("attention_forward (forward, sm_80): compiled"),
        "{}",
        stderr(&first)
    );
    let compiled = std::fs::read_to_string(&out).unwrap();
    let second = emit();
    assert_eq!(second.status.code(), Some(0), "{}", stderr(&second));
    assert!(
        stderr(&second).contains("(forward, sm_80): disk cache"),
        "{}",
        stderr(&second)
    );
    assert_eq!(std::fs::read_to_string(&out).unwrap(), compiled);
    let list = attnc_with_cache(&["cache", "list"], &cache);
    assert!(stdout(&list).contains("(1 entries)") && stdout(&list).contains("attention_forward"));
    let clear = attnc_with_cache(&["cache", "clear"], &cache);
    assert!(
        stdout(&clear).contains("removed 1 kernels"),
        "{}",
        stdout(&clear)
    );
    assert!(stderr(&emit()).contains(": compiled"));
}
