// The Python module of the CPU kernels (kv/cpu_kernel.py builds it).
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention);
  m.def("select_blocks", &select_blocks);
  m.def("rotate", &rotate);
  m.def("gather_blocks", &gather_blocks);
  m.def("block_max", &block_max);
  pybind11::class_<BlockLru, std::shared_ptr<BlockLru>>(m, "BlockLru")
      .def(pybind11::init<int64_t, int64_t>())
      .def("touch", &BlockLru::touch)
      .def("resize", &BlockLru::resize)
      .def("clear", &BlockLru::clear)
      .def_property_readonly("used", &BlockLru::used)
      .def_property_readonly("hits", &BlockLru::hits)
      .def_property_readonly("misses", &BlockLru::misses);
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t,
                          at::Tensor, bool, bool, std::shared_ptr<BlockLru>, int64_t>())
      .def("decode", &DecodeLayer::decode);
}
