fn main() {
    // sqlx::migrate! embeds the files; cargo cannot see that on its own.
    println!("cargo:rerun-if-changed=../../migrations/allocator");
}
