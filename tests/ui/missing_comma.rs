use attn::attention;

#[attention(heads = 8 head_dim = 64)]
struct Variant;

fn main() {}
