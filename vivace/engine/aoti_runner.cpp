// Runs an AOTInductor package with the GIL released: torch's own Python binding of the package
// loader (torch._C._aoti.AOTIModelPackageLoader.boxed_run) holds the GIL for the whole run, so
// while the engine thread runs a compiled decode step the server's event loop cannot send the
// tokens of the step before: a stream then gets two tokens a step late, one gap twice as long.
//
// Ops (handles are small integers into a registry of open packages):
//   vivace::aoti_open(str path, str[] names, Tensor[] tensors) -> int: loads the package and binds
//     its constants to the given tensors, without a copy (user managed); every constant the
//     package names must be among `names`.
//   vivace::aoti_run(int handle, Tensor[] inputs) -> Tensor[]: one run, the GIL released if held.
//   vivace::aoti_close(int handle) -> ()
#include <ATen/core/Tensor.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/library.h>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

// The CPython calls that release and retake the GIL, declared here rather than through Python.h
// (this library is loaded into a Python process, which provides them).
extern "C" {
int PyGILState_Check(void);
void* PyEval_SaveThread(void);
void PyEval_RestoreThread(void*);
}

namespace {

using torch::inductor::AOTIModelPackageLoader;

std::mutex registry_mutex;
std::vector<std::shared_ptr<AOTIModelPackageLoader>> registry;  // index = handle; closed: null

std::shared_ptr<AOTIModelPackageLoader> lookup(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(registry.size()) && registry[handle],
              "aoti_run: no open package ", handle);
  return registry[handle];
}

int64_t aoti_open(const std::string& path, const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(names.size() == tensors.size(), "aoti_open: names and tensors differ in length");
  auto loader = std::make_shared<AOTIModelPackageLoader>(path, "model", false, 1, -1);
  std::unordered_map<std::string, at::Tensor> given;
  for (size_t i = 0; i < names.size(); ++i) given.emplace(names[i], tensors[i]);
  std::unordered_map<std::string, at::Tensor> constants;
  for (const auto& fqn : loader->get_constant_fqns()) {
    const auto found = given.find(fqn);
    TORCH_CHECK(found != given.end(), "aoti_open: the package expects a tensor the model lacks: ", fqn);
    constants.emplace(fqn, found->second);
  }
  loader->load_constants(constants, false, true, true);
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.push_back(std::move(loader));
  return static_cast<int64_t>(registry.size()) - 1;
}

// The GIL released for this object's lifetime when the calling thread holds it, and retaken
// when it ends, whether the body returns or throws.
class GilReleased {
 public:
  GilReleased() : saved_(PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilReleased() {
    if (saved_) PyEval_RestoreThread(saved_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  void* saved_;
};

std::vector<at::Tensor> aoti_run(int64_t handle, std::vector<at::Tensor> inputs) {
  const auto loader = lookup(handle);
  const GilReleased released;
  return loader->boxed_run(std::move(inputs));
}

void aoti_close(int64_t handle) {
  std::shared_ptr<AOTIModelPackageLoader> closing;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (handle >= 0 && handle < static_cast<int64_t>(registry.size())) closing = std::move(registry[handle]);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vivace, m) {
  m.def("aoti_open(str path, str[] names, Tensor[] tensors) -> int");
  m.def("aoti_run(int handle, Tensor[] inputs) -> Tensor[]");
  m.def("aoti_close(int handle) -> ()");
}

TORCH_LIBRARY_IMPL(vivace, CatchAll, m) {
  m.impl("aoti_open", &aoti_open);
  m.impl("aoti_run", &aoti_run);
  m.impl("aoti_close", &aoti_close);
}
