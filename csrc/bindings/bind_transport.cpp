// kog._C.ShmTransport: the shared-memory collectives of tensor-parallel ranks on one host
// (csrc/engine/shm_transport.h). Buffers are raw addresses; every call releases the GIL.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "engine/shm_transport.h"

namespace py = pybind11;
using kog::engine::ShmTransport;

void bind_transport(py::module_& m) {
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<ShmTransport, std::shared_ptr<ShmTransport>>(
      m, "ShmTransport", "Shared-memory collectives between the tensor-parallel ranks of one host.")
      .def(py::init<const std::string&, int, int, int64_t, int, int64_t, double>(), arg("name"), arg("rank"),
           arg("size"), arg("reduce_floats"), arg("n_slots"), arg("slot_bytes"), arg("timeout_s"), nogil)
      .def_property_readonly("rank", &ShmTransport::rank)
      .def_property_readonly("size", &ShmTransport::size)
      .def("all_reduce", [](ShmTransport& t, uintptr_t x, int64_t n) { t.all_reduce(reinterpret_cast<float*>(x), n); },
           arg("x"), arg("n"), nogil, "In place: n f32 at x become the sum over ranks (rank order).")
      .def("publish", [](ShmTransport& t, int slot, uintptr_t part, int64_t bytes) {
             t.publish(slot, reinterpret_cast<const void*>(part), bytes);
           }, arg("slot"), arg("part"), arg("bytes"), nogil)
      .def("slot_part", [](const ShmTransport& t, int slot) { return reinterpret_cast<uintptr_t>(t.slot_part(slot)); },
           arg("slot"), "Address of this rank's part of the slot: written there, a publish copies nothing.")
      .def("prefetch", &ShmTransport::prefetch, arg("slot"), arg("bytes"),
           "Hint: the other ranks' flags and parts of the slot toward this core, ahead of a wait.")
      .def("wait", [](ShmTransport& t, int slot) { return reinterpret_cast<uintptr_t>(t.wait(slot)); },
           arg("slot"), nogil, "Address of the slot's [size][slot_bytes] parts once every rank published.")
      .def("set_link_latency_us", &ShmTransport::set_link_latency_us, arg("us"))
      .def("set_noop", &ShmTransport::set_noop, arg("noop"))
      .def("stats", [](const ShmTransport& t) {
             auto one = [](const ShmTransport::CommStats& c) {
               py::dict d;
               d["count"] = c.count, d["inside_s"] = c.inside_s, d["wait_s"] = c.wait_s, d["link_s"] = c.link_s;
               return d;
             };
             py::dict d;
             d["all_reduce"] = one(t.reduce_stats()), d["gather"] = one(t.gather_stats());
             return d;
           }, "Per kind of collective since the last reset_stats: count, inside_s (time inside the calls: "
              "the exposed communication), wait_s (spinning for other ranks), link_s (copies + link latency).")
      .def("reset_stats", &ShmTransport::reset_stats);
}
