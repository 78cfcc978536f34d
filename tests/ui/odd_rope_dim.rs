use attn::attention;

#[attention(heads = 8, head_dim = 64, position = rope(dim = 63))]
struct Variant;

fn main() {}
