//! `let` bindings in modifier closures: substituted into the IR, printed back, bounded, and
//! refused clearly where they would rebind a name.

use crate::support::rejects;
use attn_dsl::{AttentionSpec, parse_str};

fn spec(text: &str) -> AttentionSpec {
    parse_str(text).unwrap_or_else(|e| panic!("`{text}` should parse:\n{}", e.render(text)))
}

const HEAD: &str = "heads = 4, head_dim = 16, params(slope: [heads]), ";

#[test]
fn a_binding_computes_what_its_expression_written_out_computes() {
    let with_let = spec(&format!(
        "{HEAD}score_mod = |score, b, h, q, k| let d = (q - k).abs(); score - slope[h] * d as f32"
    ));
    let written_out = spec(&format!(
        "{HEAD}score_mod = |score, b, h, q, k| score - slope[h] * (q - k).abs() as f32"
    ));
    let (a, b) = (
        with_let.score_mod.as_ref().unwrap(),
        written_out.score_mod.as_ref().unwrap(),
    );
    assert_eq!(a.body, b.body, "the same IR");
    assert_eq!(a.lets.len(), 1);
    assert_eq!(a.lets[0].name, "d");
    assert!(b.lets.is_empty());
}

#[test]
fn closures_with_bindings_print_back_with_them_and_parse_to_the_same_spec() {
    for text in [
        // The unbraced form and Rust's block form.
        "score_mod = |score, b, h, q, k| let d = (q - k).abs(); score - slope[h] * d as f32",
        "score_mod = |s, _, h, q, k| { let d = (q - k) as f32; let w = slope[h] * d; s - w * w }",
        // Bindings inside a branch, and a mask with a binding used twice.
        "score_mod = |s, b, h, q, k| if q > k { let x = s * 2.0; x + x } else { s }",
        "mask_mod = |b, h, q, k| let w = 3; q - k <= w && k - q <= w",
        // A binding of a constant, and one the body never uses.
        "score_mod = |s, b, h, q, k| let c = 0.5; let unused = q + 1; s * c",
    ] {
        let first = spec(&format!("{HEAD}{text}"));
        let printed = first.to_string();
        assert!(printed.contains("let "), "`{printed}` keeps its bindings");
        let again = spec(&printed);
        assert_eq!(again, first, "`{printed}` parses back to the same spec");
        assert_eq!(again.to_string(), printed, "and prints the same");
    }
}

#[test]
fn printed_bindings_name_their_uses() {
    let s = spec(&format!(
        "{HEAD}score_mod = |score, b, h, q, k| let d = (q - k).abs(); let e = d * d; \
         score - slope[h] * (d + e) as f32"
    ));
    let printed = s.score_mod.as_ref().unwrap().to_string();
    assert_eq!(
        printed,
        "|score, b, h, q, k| { let d = (q - k).abs(); let e = d * d; \
         score - slope[h] * (d + e) as f32 }"
    );
}

#[test]
fn bindings_that_rebind_a_name_are_refused_at_the_name() {
    let m = "heads = 4, head_dim = 16, params(slope: [heads]), ";
    rejects(
        &format!("{m}score_mod = |s, b, h, q, k| let q = q + 1; s"),
        "`q` is a closure parameter; a `let` in a modifier binds a new name",
        "let ",
        "q",
    );
    rejects(
        &format!("{m}score_mod = |s, b, h, q, k| let slope = 1.0; s"),
        "`slope` is a tensor declared in params(...) or data(...)",
        "let ",
        "slope",
    );
    rejects(
        &format!("{m}score_mod = |s, b, h, q, k| let d = 1.0; let d = d + 1.0; s * d"),
        "`d` is bound by another `let` of this closure",
        "let d = 1.0; let ",
        "d",
    );
}

#[test]
fn malformed_bindings_are_refused_with_what_is_allowed() {
    let m = "heads = 4, head_dim = 16, ";
    rejects(
        &format!("{m}score_mod = |s, b, h, q, k| let d: f32 = s; d"),
        "takes no type annotation",
        "let d",
        ":",
    );
    rejects(
        &format!("{m}score_mod = |s, b, h, q, k| let (x, y) = (s, s); x"),
        "binds one name: `let NAME = expr;`",
        "let ",
        "(x",
    );
    rejects(
        &format!("{m}score_mod = |s, b, h, q, k| let d; s"),
        "`let d` needs a value",
        "| ",
        "let",
    );
    rejects(
        &format!("{m}score_mod = |s, b, h, q, k| {{ let d = s; d; }}"),
        "ends with one expression",
        "| ",
        "{",
    );
    // A binding is in scope only in its block.
    rejects(
        &format!("{m}score_mod = |s, b, h, q, k| if q > k {{ let x = s; x }} else {{ x }}"),
        "unknown name `x`",
        "else { ",
        "x",
    );
}

#[test]
fn chains_of_bindings_cannot_grow_the_tree_without_bound() {
    // Each binding doubles the tree: 40 of them would be 2^40 nodes.
    let mut body = String::from("let x0 = s;");
    for i in 1..40 {
        body.push_str(&format!(" let x{i} = x{p} + x{p};", p = i - 1));
    }
    let text = format!("heads = 4, head_dim = 16, score_mod = |s, b, h, q, k| {body} x39");
    let errs = parse_str(&text).expect_err("refused");
    assert!(
        errs.0[0].message.contains("expand to more than")
            || errs.0[0].message.contains("operations deep"),
        "{errs}"
    );
    // A long chain of small bindings is as deep as its substituted tree, and bounded too.
    let mut body = String::from("let x0 = s;");
    for i in 1..400 {
        body.push_str(&format!(" let x{i} = x{} + 1.0;", i - 1));
    }
    let text = format!("heads = 4, head_dim = 16, score_mod = |s, b, h, q, k| {body} x399");
    let errs = parse_str(&text).expect_err("refused");
    assert!(
        errs.0[0].message.contains("operations deep")
            || errs.0[0].message.contains("expand to more than"),
        "{errs}"
    );
    // Two bindings each within the limits, deeper than them together, are refused for depth.
    let minus = "-".repeat(200);
    let text = format!(
        "heads = 4, head_dim = 16, score_mod = |s, b, h, q, k| \
         let x = {minus}s; let y = {minus}x; y"
    );
    let errs = parse_str(&text).expect_err("refused");
    assert!(errs.0[0].message.contains("operations deep"), "{errs}");
}
