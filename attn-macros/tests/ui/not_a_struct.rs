use attn_macros::attention;

#[attention(heads = 8, head_dim = 64)]
enum NotAStruct {
    A,
}

fn main() {}
