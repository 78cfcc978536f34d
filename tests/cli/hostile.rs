//! Inputs that used to crash, hang or wrap: each is refused with exit code 2.

use crate::{attnc, stderr};

/// Inputs that used to crash, hang or wrap: each exits 2 with a message naming the problem,
/// quickly and with bounded output.
#[test]
fn hostile_inputs_are_refused_with_exit_2() {
    let deep = format!(
        "heads = 2, head_dim = 8, score_mod = |s, b, h, q, k| {}s{}",
        "(".repeat(3000),
        ")".repeat(3000)
    );
    let many = format!("heads = 8, head_dim = 64{}", ", heads = 4".repeat(5000));
    let digits = format!("heads = {}, head_dim = 64", "9".repeat(60_000));
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-tiny/llama_gqa"
    );
    let generate = |extra: &[&'static str]| {
        let mut args = vec!["generate", "--model", model, "--tokens", "1,2"];
        args.extend_from_slice(extra);
        args
    };
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["check", &deep], "brackets nest too deeply"),
        (vec!["check", &many], "more errors"),
        (vec!["check", &digits], "characters long"),
        (
            vec!["check", "-heads = 4, head_dim = 64"],
            "expected a key name",
        ),
        (vec!["check", "@/dev/zero"], "is a character device"),
        (
            vec![
                "explain",
                "heads = 4, head_dim = 64",
                "--seq",
                "18446744073709551615",
            ],
            "does not fit in 64 bits",
        ),
        (
            vec![
                "bench",
                "heads = 4, head_dim = 64",
                "--seq",
                "1048576",
                "--batch",
                "4096",
            ],
            "GiB of memory",
        ),
        (
            vec![
                "bench-decode",
                "heads = 32, head_dim = 128",
                "--kv-len",
                "1048576",
                "--batch",
                "4096",
            ],
            "GiB of memory",
        ),
        (vec!["peak", "--seconds", "inf"], "allowed: more than 0"),
        (
            generate(&["--max-new-tokens", "18446744073709551615"]),
            "2^64 tokens",
        ),
        (generate(&["--top-k", "0"]), "--top-k 0"),
        (
            vec!["ir", "heads = 4, head_dim = 64", "--seq", "1048576"],
            "16384",
        ),
        (vec!["peak", "--seconds", "NaN"], "allowed: more than 0"),
    ];
    for (args, needle) in cases {
        let o = attnc(&args);
        let err = stderr(&o);
        let shown: String = format!("{args:?}").chars().take(120).collect();
        assert_eq!(o.status.code(), Some(2), "{shown}: {err}");
        assert!(err.contains(needle), "{shown}: `{needle}` not in {err}");
        assert!(
            err.len() < 16 * 1024,
            "{shown}: {} bytes on stderr",
            err.len()
        );
    }
}
