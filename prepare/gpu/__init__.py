"""Step 1, the GPU gate, and what it reads: NVIDIA cards through NVML
(`nvml`, their health in `health`, the driver directory a Nix-built program
finds the driver in, `driver_dir`), AMD cards from the amdgpu driver's KFD
topology (`amd`), what a survey found (`devices`), and the tables of
`fdl-prepare gpus` (`table`). `gate` is the step."""
