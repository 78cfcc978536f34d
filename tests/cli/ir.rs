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
