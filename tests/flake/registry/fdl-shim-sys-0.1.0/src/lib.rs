extern "C" {
    fn fdl_shim_ones_sum(n: i64) -> f64;
}

/// The sum of `n` ones, computed by libtorch.
pub fn ones_sum(n: i64) -> f64 {
    unsafe { fdl_shim_ones_sum(n) }
}
