// `sqlx::migrate!` embeds `migrations/` when the crate compiles, but cargo
// only knows to recompile for a changed source file: without this, a new
// migration is left out of an incremental build (`sqlx migrate
// build-script` writes the same line).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
