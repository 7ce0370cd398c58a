//! `gpu-check`: the GPU backend's checks ([`zerolayer_worker::device_check`]), run on a GPU
//! machine by `scripts/gpu-check`, and on the CUDA emulator by `scripts/test`.

fn main() {
    std::process::exit(zerolayer_worker::device_check::main_with_args(std::env::args().skip(1)));
}
