// The Python module of the CPU kernels (kv/cpu_kernel.py builds it).
#include <torch/extension.h>

#include <vector>

torch::Tensor decode_attention(torch::Tensor q0, torch::Tensor q1,
                               std::vector<torch::Tensor> k_srcs, std::vector<torch::Tensor> v_srcs,
                               std::vector<int64_t> qids, std::vector<int64_t> strides,
                               std::vector<int64_t> rows, std::vector<torch::Tensor> starts,
                               std::vector<int64_t> formats, int64_t n_kv, double scale);

torch::Tensor select_blocks(torch::Tensor q, torch::Tensor anchors, int64_t first, int64_t last,
                            int64_t k, bool quest, bool shared);

torch::Tensor rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention);
  m.def("select_blocks", &select_blocks);
  m.def("rotate", &rotate);
}
