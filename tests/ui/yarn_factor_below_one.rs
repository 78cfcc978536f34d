use attn::attention;

#[attention(heads = 8, head_dim = 64, position = rope(scaling = yarn(factor = 0.5, original_max_position = 4096)))]
struct Variant;

fn main() {}
