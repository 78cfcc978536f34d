use attn::attention;

#[attention(heads = 8, head_dim = 64, mask = causa)]
struct Variant;

fn main() {}
