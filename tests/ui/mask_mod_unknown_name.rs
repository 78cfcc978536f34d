use attn::attention;

#[attention(heads = 8, head_dim = 64, mask_mod = |b, h, q, k| pos < k)]
struct Variant;

fn main() {}
