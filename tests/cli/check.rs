//! `attnc check`: the normalized spec, errors with exit code 2, specs from files.

use crate::{attnc, stderr, stdout};

#[test]
fn check_prints_the_normalized_spec() {
    let o = attnc(&[
        "check",
        "heads = 8, kv_heads = 2, head_dim = 64, mask = causal",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        stdout(&o).trim(),
        "heads = 8, kv_heads = 2, head_dim = 64, v_head_dim = 64, mask = causal, position = \
         none, dtype = f32"
    );
}

#[test]
fn check_rejects_a_bad_group_count_with_exit_code_2() {
    let o = attnc(&["check", "heads = 32, kv_heads = 5, head_dim = 128"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains("heads (32) is not a multiple of kv_heads (5)"),
        "{err}"
    );
    assert!(err.contains(" --> 1:24"), "{err}");
    assert!(stdout(&o).is_empty());
}

#[test]
fn check_suggests_the_key_a_typo_meant() {
    let o = attnc(&["check", "heads = 32, kv_hedas = 8, head_dim = 128"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("did you mean `kv_heads`?"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn specs_can_come_from_files() {
    let dir = std::env::temp_dir().join(format!("attnc-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.attn");
    std::fs::write(
        &good,
        "heads = 4,\nhead_dim = 32,\nmask = sliding_window(128)\n",
    )
    .unwrap();
    let o = attnc(&["check", &format!("@{}", good.display())]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("mask = sliding_window(128)"));

    let bad = dir.join("bad.attn");
    std::fs::write(
        &bad,
        "heads = 4,\nhead_dim = 32,\nmask = sliding_window(0)\n",
    )
    .unwrap();
    let o = attnc(&["check", &format!("@{}", bad.display())]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains(" --> 3:23") && err.contains("spec file"),
        "{err}"
    );

    let o = attnc(&["check", "@/nonexistent/spec.attn"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("cannot read spec file `/nonexistent/spec.attn`"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn check_notes_a_piecewise_derivative_on_stderr() {
    let o = attnc(&[
        "check",
        "heads = 4, head_dim = 64, score_mod = |s, b, h, q, k| s.abs()",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // At the tokens: `s.abs()` starts at column 55.
    assert!(
        stderr(&o).contains("note: backward: `score.abs()`: the derivative is piecewise")
            && stderr(&o).contains(" --> 1:55\n"),
        "{}",
        stderr(&o)
    );
    let o = attnc(&["check", "heads = 4, head_dim = 64, softcap = 30.0"]);
    assert_eq!(stderr(&o), "");
}

/// A data tensor read along `seq` at the query position is warned about (FlexAttention indexes
/// queries from 0 in every call; attn aligns them bottom-right); one read at the key is not.
#[test]
fn check_warns_where_a_data_tensor_is_read_at_the_query() {
    let spec = |mask: &str| {
        format!(
            "heads = 2, head_dim = 8, data(doc: [batch, seq] i32, len: [batch] i32), \
             mask_mod = |b, h, q, k| {mask}"
        )
    };
    let o = attnc(&["check", &spec("doc[b, q] == doc[b, k]")]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("warning: mask_mod reads `doc` along `seq` at `q`")
            && err.contains("Skv - Sq + i"),
        "{err}"
    );
    let o = attnc(&["check", &spec("doc[b, k] >= 0 && k < len[b]")]);
    assert_eq!(stderr(&o), "");
}

/// Learnable tensors that all start where their gradient is 0 are noted; with a start that
/// lets training move them, the note goes, and the start prints back.
#[test]
fn check_notes_learnable_tensors_that_training_cannot_move() {
    let kerple = |init: &str| {
        format!(
            "heads = 2, head_dim = 8, mask = causal, params(r1: [heads]{init}, r2: [heads]), \
             score_mod = |s, b, h, q, k| s - r1[h] * (1.0 + r2[h] * (q - k).abs() as f32).ln()"
        )
    };
    let o = attnc(&["check", &kerple("")]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "note: training: the learnable tensors (r1, r2) all start where \
             their gradient is 0"
        ),
        "{}",
        stderr(&o)
    );
    let o = attnc(&["check", &kerple(" = normal(0.02)")]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stderr(&o).contains("note: training"), "{}", stderr(&o));
    assert!(stdout(&o).contains("params(r1: [heads] = normal(0.02), r2: [heads])"));
}
