//! `attnc ir`: each pass's IR, the tile map, and the derivative program.

use crate::{attnc, stderr, stdout};

#[test]
fn ir_prints_each_pass_and_the_tile_map() {
    let o = attnc(&[
        "ir",
        "heads = 4, head_dim = 64, mask = causal",
        "--seq",
        "512",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let t = stdout(&o);
    for section in [
        "-- modifier IR, lowered --\nscore = score * 0.125\nmask = k <= q\n",
        "-- modifier IR, folded --\n",
        "-- kernel plan --\nplan Forward\n",
        // Blocks of 256 query rows by tiles of 64 keys.
        "-- tiles at Sq = 512, Skv = 512 (4 all kept #, 4 skipped ., 8 mixed /) --\n\
         ////....\n####////\n",
    ] {
        assert!(t.contains(section), "missing {section:?} in:\n{t}");
    }
    // Differential heads: the plan is the component heads', and the pairing is said.
    let o = attnc(&[
        "ir",
        "heads = 4, kv_heads = 2, head_dim = 64, v_head_dim = 128, differential = lambda",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(
            "-- differential heads --\nthe plan above runs 4 component heads; head h of 2 takes \
             O_2h - lambda O_2h+1 (value heads: 1,"
        ),
        "{}",
        stdout(&o)
    );
    let o = attnc(&["ir", "heads = 4, head_dim = 64, mask = causal, softcap = 0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("softcap = 0 is invalid"));
}

#[test]
fn ir_grad_prints_the_derivative_and_its_notes() {
    let o = attnc(&[
        "ir",
        "heads = 4, head_dim = 64, softcap = 30.0, score_mod = |s, b, h, q, k| s.max(-5.0)",
        "--grad",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("-- d score / d raw score (folded) --"),
        "{text}"
    );
    assert!(text.contains("tanh"), "{text}");
    assert!(text.contains("note: `"), "{text}");
    assert!(text.contains("plan Backward"), "{text}");
}

/// The blue runs of kept pairs an `attnc ir --svg` picture holds, one per run along a row
/// (every pair a cell of its own at these sizes), less the legend's swatch.
fn kept_runs(spec: &str, seq: &str, tag: &str) -> (usize, String) {
    let path = std::env::temp_dir().join(format!("attnc-mask-{tag}-{}.svg", std::process::id()));
    let o = attnc(&["ir", spec, "--seq", seq, "--svg", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    (svg.matches("fill=\"#19326E\"").count() - 1, svg)
}

#[test]
fn a_mask_picture_shows_the_kept_pairs_and_the_tiles() {
    // Causal: row i keeps keys 0..=i, one run per row.
    let (runs, svg) = kept_runs("heads = 1, head_dim = 16, mask = causal", "8", "causal");
    assert_eq!(runs, 8);
    assert!(
        svg.starts_with("<svg") && svg.contains("masked per element"),
        "{svg}"
    );
    // Even keys only: four runs in each of 8 rows.
    let (runs, _) = kept_runs(
        "heads = 1, head_dim = 16, mask_mod = |b, h, q, k| k % 2 == 0",
        "8",
        "even",
    );
    assert_eq!(runs, 32);
    // A long call: a bounded picture (cells cover blocks of pairs), tiles counted.
    let (_, svg) = kept_runs(
        "heads = 1, head_dim = 16, mask = sliding_window(128)",
        "4096",
        "long",
    );
    assert!(svg.len() < 2_000_000, "{} bytes", svg.len());
    assert!(
        svg.contains("skipped,") && svg.contains("tile skipped"),
        "{svg}"
    );
}

#[test]
fn a_mask_picture_needs_seq_and_a_writable_file() {
    let o = attnc(&["ir", "heads = 1, head_dim = 16", "--svg", "x.svg"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--seq"), "{}", stderr(&o));
    let dir = std::env::temp_dir();
    let o = attnc(&[
        "ir",
        "heads = 1, head_dim = 16",
        "--seq",
        "8",
        "--svg",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // More queries than keys (the first queries before every key): drawn all the same.
    let path = std::env::temp_dir().join(format!("attnc-mask-kv-{}.svg", std::process::id()));
    let spec = "heads = 1, head_dim = 16, mask = causal";
    let o = attnc(&[
        "ir",
        spec,
        "--seq",
        "8",
        "--kv-len",
        "4",
        "--svg",
        path.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(
        svg.matches("fill=\"#19326E\"").count() - 1,
        4,
        "rows 4 to 7 see keys (and the legend's swatch)"
    );
}

#[test]
fn ir_grad_prints_the_derivative_with_respect_to_each_parameter_read() {
    let o = attnc(&[
        "ir",
        "heads = 4, head_dim = 64, scale = 1.0, sinks = learned, params(t: [heads]), \
         score_mod = |s, b, h, q, k| s * t[h] + t[h]",
        "--grad",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    // d (s t + t) / d t = s + 1.
    assert!(
        text.contains("-- d score / d t[h] (folded) --\nscore + 1.0\n"),
        "{text}"
    );
    assert!(text.contains("-- d score / d sinks --"), "{text}");
    assert!(
        text.contains("params    one 32-bit buffer: t [4] at 0"),
        "{text}"
    );
}

/// A picture that does not fit on the disk (a file-size limit, with SIGXFSZ ignored) leaves
/// the picture before whole and no temporary file.
#[cfg(target_os = "linux")]
#[test]
fn a_mask_picture_is_written_whole_or_not_at_all() {
    let dir = std::env::temp_dir().join(format!("attnc-mask-full-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("mask.svg");
    std::fs::write(&svg, "the picture before").unwrap();
    let o = crate::attnc_under(
        "trap '' XFSZ; ulimit -f 8",
        &[
            "ir",
            "heads = 1, head_dim = 16, mask = causal",
            "--seq",
            "256",
            "--svg",
            svg.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot write"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&svg).unwrap(), "the picture before");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        1,
        "no temporary file"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A picture over the spec file it reads is refused, naming `--svg`.
#[test]
fn a_mask_picture_over_its_spec_file_names_svg() {
    let spec = std::env::temp_dir().join(format!("attnc-mask-spec-{}.attn", std::process::id()));
    std::fs::write(&spec, "heads = 1, head_dim = 16, mask = causal").unwrap();
    let at = format!("@{}", spec.display());
    let o = attnc(&["ir", &at, "--seq", "8", "--svg", spec.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).starts_with("error: --svg") && stderr(&o).contains("overwrite"),
        "{}",
        stderr(&o)
    );
    std::fs::remove_file(&spec).ok();
}
