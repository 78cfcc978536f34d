use attn::attention;

#[attention(heads = 8, head_dim = 64, score_mod = |score, b, h, q, k| score * q)]
struct Variant;

fn main() {}
