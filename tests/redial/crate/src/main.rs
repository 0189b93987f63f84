// The run's own code: what a re-dial after a one-line change recompiles.
fn main() {
    let n: i64 = 7;
    let sum = fdl_shim_sys::ones_sum(n);
    let mut buf = itoa::Buffer::new();
    println!("redial: libtorch summed {} ones to {}", buf.format(n), sum);
}
