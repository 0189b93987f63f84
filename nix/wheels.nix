# libtorch as PyTorch publishes it in its wheels: each variant's wheels,
# pinned by URL and sha256, per system. Data only: nix/libtorch-wheel.nix
# turns a variant into a floDl-shaped libtorch, and nix/libtorch.nix reads
# `cuda` and `archs` from here without building anything.
#
# Where each pin comes from:
#   - cu128 (x86_64): PyPI's own `torch==2.10.0` is PyTorch's CUDA 12.8 build
#     (its torch/version.py says 2.10.0+cu128); its CUDA libraries are the
#     nvidia-*-cu12 wheels its metadata requires, at exactly those versions,
#     plus nvidia-cuda-nvcc-cu12 (crt/host_config.h) and nvidia-cuda-cccl-cu12
#     (CUDA's C++ headers), which floDl's CUDA shim needs to compile. URLs and
#     sha256 are PyPI's simple index entries for those files, as
#     `pip install --dry-run --report` prints them (download_info.url,
#     archive_info.hashes.sha256), for cp311 on manylinux_2_28 x86_64; every
#     file was downloaded and checked against them.
#   - cpu (x86_64): torch-2.10.0+cpu from PyTorch's index,
#     https://download.pytorch.org/whl/cpu/; the sha256 is the one public
#     Dockerfiles pin it with (`ARG TORCH_CPU_WHL=…torch-2.10.0%2Bcpu-cp313-cp313-manylinux_2_28_x86_64.whl#sha256=…`).
#     Only the libtorch inside is used, so the Python tag does not matter.
#   - cpu (aarch64): PyPI's `torch==2.10.0` for aarch64, which is the CPU
#     build (its torch/version.py says 2.10.0+cpu; no libtorch_cuda.so);
#     sha256 from PyPI's index, and the downloaded file matched it.
#   - No cu128 for aarch64: PyTorch's +cu128 aarch64 wheel is on its own
#     index only, and no public source quoted its hash.
#   - cu126: not shipped. torch-2.10.0+cu126 (cp311, x86_64) is quoted with
#     sha256 a9a9ba3b2baf23c044499ffbcbed88e04b6e38b94189c7dc42dd2cfcdd8c55c0,
#     but the nvidia-*-cu12 12.6 set it requires is only in that wheel's
#     metadata, which nothing here could read: nix/CONTRACT.md, "Adding a
#     variant", says what the entry takes.
#
# `archs` are the compute capabilities libtorch_cuda.so carries kernels for.
# They are literals because the runner's arch coverage reads them at
# evaluation, where nothing may be built; the build reads the wheel's
# fatbinary and fails if they differ (nix/libtorch-wheel.py), so the two
# cannot drift apart.
{
  version = "2.10.0";
  variants = {
    cpu = {
      cuda = null;
      archs = [ ];
      wheels = {
        x86_64-linux = [
          {
            url = "https://download.pytorch.org/whl/cpu/torch-2.10.0%2Bcpu-cp313-cp313-manylinux_2_28_x86_64.whl";
            sha256 = "8d316e5bf121f1eab1147e49ad0511a9d92e4c45cc357d1ab0bee440da71a095";
          }
        ];
        aarch64-linux = [
          {
            url = "https://files.pythonhosted.org/packages/78/89/f5554b13ebd71e05c0b002f95148033e730d3f7067f67423026cc9c69410/torch-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl";
            sha256 = "3282d9febd1e4e476630a099692b44fdc214ee9bf8ee5377732d9d9dfe5712e4";
          }
        ];
      };
    };
    cu128 = {
      cuda = "12.8";
      archs = [
        "7.0"
        "7.5"
        "8.0"
        "8.6"
        "9.0"
        "10.0"
        "12.0"
      ];
      # The torch wheel first: it is the libtorch; the others are its CUDA.
      wheels = {
      x86_64-linux = [
        {
          url = "https://files.pythonhosted.org/packages/36/ab/7b562f1808d3f65414cd80a4f7d4bb00979d9355616c034c171249e1a303/torch-2.10.0-3-cp311-cp311-manylinux_2_28_x86_64.whl";
          sha256 = "ac5bdcbb074384c66fa160c15b1ead77839e3fe7ed117d667249afce0acabfac";
        }
        {
          url = "https://files.pythonhosted.org/packages/0d/9b/a997b638fcd068ad6e4d53b8551a7d30fe8b404d6f1804abf1df69838932/nvidia_cuda_runtime_cu12-12.8.90-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
          sha256 = "adade8dcbd0edf427b7204d480d6066d33902cab2a4707dcfc48a2d0fd44ab90";
        }
        {
          url = "https://files.pythonhosted.org/packages/6e/89/f7a07dc961b60645dbbf42e80f2bc85ade7feb9a491b11a1e973aa00071f/nvidia_nccl_cu12-2.27.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
          sha256 = "ad730cf15cb5d25fe849c6e6ca9eb5b76db16a80f13f425ac68d8e2e55624457";
        }
        {
          url = "https://files.pythonhosted.org/packages/dc/61/e24b560ab2e2eaeb3c839129175fb330dfcfc29e5203196e5541a4c44682/nvidia_cublas_cu12-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl";
          sha256 = "8ac4e771d5a348c551b2a426eda6193c19aa630236b418086020df5ba9667142";
        }
        {
          url = "https://files.pythonhosted.org/packages/c2/f5/e1854cb2f2bcd4280c44736c93550cc300ff4b8c95ebe370d0aa7d2b473d/nvidia_cusparse_cu12-12.5.8.93-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
          sha256 = "1ec05d76bbbd8b61b06a80e1eaf8cf4959c3d4ce8e711b65ebd0443bb0ebb13b";
        }
        {
          url = "https://files.pythonhosted.org/packages/85/48/9a13d2975803e8cf2777d5ed57b87a0b6ca2cc795f9a4f59796a910bfb80/nvidia_cusolver_cu12-11.7.3.90-py3-none-manylinux_2_27_x86_64.whl";
          sha256 = "4376c11ad263152bd50ea295c05370360776f8c3427b30991df774f9fb26c450";
        }
        {
          url = "https://files.pythonhosted.org/packages/1f/13/ee4e00f30e676b66ae65b4f08cb5bcbb8392c03f54f2d5413ea99a5d1c80/nvidia_cufft_cu12-11.3.3.83-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
          sha256 = "4d2dd21ec0b88cf61b62e6b43564355e5222e4a3fb394cac0db101f2dd0d4f74";
        }
        {
          url = "https://files.pythonhosted.org/packages/fb/aa/6584b56dc84ebe9cf93226a5cde4d99080c8e90ab40f0c27bda7a0f29aa1/nvidia_curand_cu12-10.3.9.90-py3-none-manylinux_2_27_x86_64.whl";
          sha256 = "b32331d4f4df5d6eefa0554c565b626c7216f87a06a4f56fab27c3b68a830ec9";
        }
        {
          url = "https://files.pythonhosted.org/packages/ba/51/e123d997aa098c61d029f76663dedbfb9bc8dcf8c60cbd6adbe42f76d049/nvidia_cudnn_cu12-9.10.2.21-py3-none-manylinux_2_27_x86_64.whl";
          sha256 = "949452be657fa16687d0930933f032835951ef0892b37d2d53824d1a84dc97a8";
        }
        {
          url = "https://files.pythonhosted.org/packages/56/79/12978b96bd44274fe38b5dde5cfb660b1d114f70a65ef962bcbbed99b549/nvidia_cusparselt_cu12-0.7.1-py3-none-manylinux2014_x86_64.whl";
          sha256 = "f1bb701d6b930d5a7cea44c19ceb973311500847f81b634d802b7b539dc55623";
        }
        {
          url = "https://files.pythonhosted.org/packages/f6/74/86a07f1d0f42998ca31312f998bd3b9a7eff7f52378f4f270c8679c77fb9/nvidia_nvjitlink_cu12-12.8.93-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl";
          sha256 = "81ff63371a7ebd6e6451970684f916be2eab07321b73c9d244dc2b4da7f73b88";
        }
        {
          url = "https://files.pythonhosted.org/packages/05/6b/32f747947df2da6994e999492ab306a903659555dddc0fbdeb9d71f75e52/nvidia_cuda_nvrtc_cu12-12.8.93-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl";
          sha256 = "a7756528852ef889772a84c6cd89d41dfa74667e24cca16bb31f8f061e3e9994";
        }
        {
          url = "https://files.pythonhosted.org/packages/f8/02/2adcaa145158bf1a8295d83591d22e4103dbfd821bcaf6f3f53151ca4ffa/nvidia_cuda_cupti_cu12-12.8.90-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
          sha256 = "ea0cb07ebda26bb9b29ba82cda34849e73c166c18162d3913575b0c9db9a6182";
        }
        {
          url = "https://files.pythonhosted.org/packages/a2/eb/86626c1bbc2edb86323022371c39aa48df6fd8b0a1647bc274577f72e90b/nvidia_nvtx_cu12-12.8.90-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
          sha256 = "5b17e2001cc0d751a5bc2c6ec6d26ad95913324a4adb86788c944f8ce9ba441f";
        }
        {
          url = "https://files.pythonhosted.org/packages/bb/fe/1bcba1dfbfb8d01be8d93f07bfc502c93fa23afa6fd5ab3fc7c1df71038a/nvidia_cufile_cu12-1.13.1.3-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
          sha256 = "1d069003be650e131b21c932ec3d8969c1715379251f8d23a1860554b1cb24fc";
        }
        {
          url = "https://files.pythonhosted.org/packages/b5/09/6ea3ea725f82e1e76684f0708bbedd871fc96da89945adeba65c3835a64c/nvidia_nvshmem_cu12-3.4.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
          sha256 = "042f2500f24c021db8a06c5eec2539027d57460e1c1a762055a6554f72c369bd";
        }
        {
          url = "https://files.pythonhosted.org/packages/86/0a/962e9c861541b08d62ee38a9e9776a46f75b979c75e7236fa7e09b024470/nvidia_cuda_nvcc_cu12-12.8.93-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl";
          sha256 = "2d6dc36fb7cb5ac9c0b8825bc13d193c35487a315664007287d0126531238011";
        }
        {
          url = "https://files.pythonhosted.org/packages/c6/96/00037683ebaeefb53e710286871a3e8338d6800466441d26c498331a036d/nvidia_cuda_cccl_cu12-12.8.90-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl";
          sha256 = "575bc5cfb0fe4a1956c539215c0f1e6718821b95a68ef6b7abf226aa87e3a5ad";
        }
      ];
      };
    };
  };
}
