// The Python module of the CPU kernels (kv/cpu_kernel.py builds it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention);
  m.def("select_blocks", &select_blocks);
  m.def("rotate", &rotate);
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t,
                          torch::Tensor, bool, bool>())
      .def("decode", &DecodeLayer::decode);
}
