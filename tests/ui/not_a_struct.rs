use attn::attention;

#[attention(heads = 8, head_dim = 64)]
enum NotAStruct {
    A,
}

fn main() {}
