//! fdl-prepare's example trainer: a two-layer perceptron trained with SGD
//! through libtorch (the C++ shim in shim/shim.cpp), built the way a floDl
//! training crate is (build.rs, LIBTORCH_PATH).
//!
//!     train [--epochs N] [--data DIR] [--seed N]   train for N epochs
//!     train --smoke                                one training step, then exit
//!
//! With `--data DIR` it trains on the rows of the `*.csv` files in DIR (the
//! dataset root: numbers separated by commas, the last column the target);
//! without, on synthetic data. `--smoke` is what fdl-prepare runs before a
//! box reports ready: one forward, backward and SGD step on synthetic data,
//! the loss before and after printed, exit 1 unless the step lowered it.
//!
//! Written for Rust 1.63 (Debian 12), edition 2021, no dependencies.

use std::ffi::CStr;
use std::fs;
use std::os::raw::{c_char, c_int};
use std::path::{Path, PathBuf};
use std::process::exit;

extern "C" {
    fn example_torch_version() -> *const c_char;
    fn example_cuda_status() -> *const c_char;
    fn example_model_new(inputs: i64, hidden: i64, lr: f64, seed: u64, error: *mut *mut c_char) -> *mut u8;
    fn example_model_free(model: *mut u8);
    fn example_loss(
        model: *mut u8,
        x: *const f32,
        y: *const f32,
        rows: i64,
        inputs: i64,
        loss: *mut f64,
        error: *mut *mut c_char,
    ) -> c_int;
    fn example_step(
        model: *mut u8,
        x: *const f32,
        y: *const f32,
        rows: i64,
        inputs: i64,
        loss: *mut f64,
        error: *mut *mut c_char,
    ) -> c_int;
    fn example_message_free(message: *mut c_char);
}

const HIDDEN: i64 = 16;
const LEARNING_RATE: f64 = 0.05;
const BATCH: usize = 32;
// The dataset reader's bounds: a dataset root is someone else's directory.
const MAX_ROWS: usize = 1_000_000;
const MAX_COLUMNS: usize = 1024;

struct Data {
    inputs: usize,
    x: Vec<f32>,
    y: Vec<f32>,
}

impl Data {
    fn rows(&self) -> usize {
        self.y.len()
    }
}

struct Model {
    raw: *mut u8,
    inputs: usize,
}

impl Model {
    fn new(inputs: usize, seed: u64) -> Result<Model, String> {
        let mut error: *mut c_char = std::ptr::null_mut();
        let raw = unsafe { example_model_new(inputs as i64, HIDDEN, LEARNING_RATE, seed, &mut error) };
        if raw.is_null() {
            return Err(take_message(error));
        }
        Ok(Model { raw, inputs })
    }

    fn loss(&self, x: &[f32], y: &[f32]) -> Result<f64, String> {
        let mut loss = 0.0;
        let mut error: *mut c_char = std::ptr::null_mut();
        let rc = unsafe {
            example_loss(self.raw, x.as_ptr(), y.as_ptr(), y.len() as i64, self.inputs as i64, &mut loss, &mut error)
        };
        if rc != 0 {
            return Err(take_message(error));
        }
        Ok(loss)
    }

    fn step(&self, x: &[f32], y: &[f32]) -> Result<f64, String> {
        let mut loss = 0.0;
        let mut error: *mut c_char = std::ptr::null_mut();
        let rc = unsafe {
            example_step(self.raw, x.as_ptr(), y.as_ptr(), y.len() as i64, self.inputs as i64, &mut loss, &mut error)
        };
        if rc != 0 {
            return Err(take_message(error));
        }
        Ok(loss)
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        unsafe { example_model_free(self.raw) }
    }
}

fn take_message(message: *mut c_char) -> String {
    if message.is_null() {
        return "libtorch failed without a message".to_string();
    }
    let text = unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned();
    unsafe { example_message_free(message) };
    text
}

fn torch_version() -> String {
    unsafe { CStr::from_ptr(example_torch_version()) }.to_string_lossy().into_owned()
}

/// xorshift64*: the same synthetic data on every machine, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// y = a smooth function of four inputs, plus a little noise.
fn synthetic(rows: usize, seed: u64) -> Data {
    let inputs = 4;
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut x = Vec::with_capacity(rows * inputs);
    let mut y = Vec::with_capacity(rows);
    for _ in 0..rows {
        let row: Vec<f32> = (0..inputs).map(|_| rng.unit()).collect();
        let target = 0.8 * row[0] - 0.5 * row[1] + 0.3 * row[2] * row[3] + 0.1 + 0.01 * rng.unit();
        x.extend_from_slice(&row);
        y.push(target);
    }
    Data { inputs, x, y }
}

/// The rows of every `*.csv` file directly in `root`, in name order.
fn read_dataset(root: &Path) -> Result<Data, String> {
    let entries = fs::read_dir(root).map_err(|e| format!("cannot list the dataset root {}: {}", root.display(), e))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().map_or(false, |ext| ext == "csv") && path.is_file())
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!(
            "the dataset root {} holds no *.csv file; the example trainer reads rows of numbers separated by \
             commas, the last column the target (or run it without --data for synthetic data)",
            root.display()
        ));
    }
    let mut data = Data { inputs: 0, x: Vec::new(), y: Vec::new() };
    for file in &files {
        let text = fs::read_to_string(file).map_err(|e| format!("cannot read {}: {}", file.display(), e))?;
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let values: Result<Vec<f32>, _> = line.split(',').map(|v| v.trim().parse::<f32>()).collect();
            let values = match values {
                Ok(values) => values,
                // A header row is allowed once, at the top of a file.
                Err(_) if number == 0 => continue,
                Err(_) => return Err(format!("{}:{}: not a row of numbers: {:?}", file.display(), number + 1, line)),
            };
            if values.len() < 2 || values.len() > MAX_COLUMNS {
                return Err(format!(
                    "{}:{}: {} columns; a row has 2 to {} (the inputs, then the target)",
                    file.display(),
                    number + 1,
                    values.len(),
                    MAX_COLUMNS
                ));
            }
            if data.inputs == 0 {
                data.inputs = values.len() - 1;
            } else if values.len() - 1 != data.inputs {
                return Err(format!(
                    "{}:{}: {} columns, the rows before it have {}",
                    file.display(),
                    number + 1,
                    values.len(),
                    data.inputs + 1
                ));
            }
            data.x.extend_from_slice(&values[..data.inputs]);
            data.y.push(values[data.inputs]);
            if data.rows() >= MAX_ROWS {
                return Ok(data);
            }
        }
    }
    if data.rows() == 0 {
        return Err(format!("the *.csv files in {} hold no rows", root.display()));
    }
    Ok(data)
}

fn cuda_status() -> String {
    unsafe { CStr::from_ptr(example_cuda_status()) }.to_string_lossy().into_owned()
}

fn smoke() -> Result<(), String> {
    // The CUDA build says what it sees before training on the CPU.
    if cfg!(feature = "cuda") {
        println!("example trainer: {}", cuda_status());
    }
    let data = synthetic(64, 7);
    let model = Model::new(data.inputs, 7)?;
    let before = model.step(&data.x, &data.y)?;
    let after = model.loss(&data.x, &data.y)?;
    let line = format!(
        "example trainer: smoke: one training step (forward, backward, SGD) with libtorch {}: loss {:.6} -> {:.6}",
        torch_version(),
        before,
        after
    );
    if !before.is_finite() || !after.is_finite() || after >= before {
        return Err(format!("{}: the step did not lower the loss", line));
    }
    println!("{}", line);
    Ok(())
}

fn train(epochs: u32, data_root: Option<&Path>, seed: u64) -> Result<(), String> {
    let (data, what) = match data_root {
        Some(root) => {
            let data = read_dataset(root)?;
            let what = format!("{} rows from {}", data.rows(), root.display());
            (data, what)
        }
        None => (synthetic(1024, seed), "1024 synthetic rows".to_string()),
    };
    let model = Model::new(data.inputs, seed)?;
    println!(
        "example trainer: libtorch {}, {} inputs, {} epoch(s) on {}",
        torch_version(),
        data.inputs,
        epochs,
        what
    );
    let mut order: Vec<usize> = (0..data.rows()).collect();
    let mut rng = Rng(seed | 1);
    for epoch in 1..=epochs {
        // Fisher-Yates: a fresh order of the rows each epoch.
        for i in (1..order.len()).rev() {
            let j = (rng.next() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let mut total = 0.0;
        let mut batches = 0;
        for chunk in order.chunks(BATCH) {
            let mut x = Vec::with_capacity(chunk.len() * data.inputs);
            let mut y = Vec::with_capacity(chunk.len());
            for &row in chunk {
                x.extend_from_slice(&data.x[row * data.inputs..(row + 1) * data.inputs]);
                y.push(data.y[row]);
            }
            total += model.step(&x, &y)?;
            batches += 1;
        }
        let loss = model.loss(&data.x, &data.y)?;
        if !loss.is_finite() {
            return Err(format!("epoch {}: the loss is {}; lower the learning rate or check the data", epoch, loss));
        }
        println!(
            "example trainer: epoch {}/{}: mean step loss {:.6}, loss {:.6}",
            epoch,
            epochs,
            total / batches as f64,
            loss
        );
    }
    Ok(())
}

const USAGE: &str = "usage: train [--epochs N] [--data DIR] [--seed N] | train --smoke";

fn main() {
    let mut args = std::env::args().skip(1);
    let mut epochs: u32 = 1;
    let mut data: Option<PathBuf> = None;
    let mut seed: u64 = 1;
    let mut smoke_run = false;
    while let Some(arg) = args.next() {
        let mut value = |name: &str| match args.next() {
            Some(v) => v,
            None => {
                eprintln!("train: {} needs a value\n{}", name, USAGE);
                exit(2);
            }
        };
        match arg.as_str() {
            "--smoke" => smoke_run = true,
            "--epochs" => {
                epochs = value("--epochs").parse().unwrap_or_else(|_| {
                    eprintln!("train: --epochs takes a whole number\n{}", USAGE);
                    exit(2)
                })
            }
            "--seed" => {
                seed = value("--seed").parse().unwrap_or_else(|_| {
                    eprintln!("train: --seed takes a whole number\n{}", USAGE);
                    exit(2)
                })
            }
            "--data" => data = Some(PathBuf::from(value("--data"))),
            "-h" | "--help" => {
                println!("{}", USAGE);
                return;
            }
            other => {
                eprintln!("train: unknown argument {:?}\n{}", other, USAGE);
                exit(2);
            }
        }
    }
    let result = if smoke_run { smoke() } else { train(epochs, data.as_deref(), seed) };
    if let Err(message) = result {
        eprintln!("example trainer: {}", message);
        exit(1);
    }
}
