// Python bindings of a group's options and construction: xcomm._C.XcommOptions
// (what xcomm.Options converts to) and xcomm._C.build_group.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "backend/GroupBuilder.hpp"
#include "collectives/compressed/AutoCompression.hpp"
#include "collectives/compressed/CodecCalibration.hpp"
#include "collectives/compressed/CostModel.hpp"
#include "collectives/compressed/LinkEstimate.hpp"
#include "collectives/compressed/MethodChoice.hpp"
#include "collectives/compressed/ObservedFactors.hpp"
#include "common/Compression.hpp"
#include "common/Methods.hpp"
#include "python/Bindings.hpp"
#include "python/NoGilHolder.hpp"
#include "transport/HostIdentity.hpp"

namespace py = pybind11;

namespace {

std::string typeName(const py::handle& value) {
  return py::str(py::type::handle_of(value).attr("__name__")).cast<std::string>();
}

// Python's types, checked strictly (a bool is not an int here) and named in
// the error; the values are checked by XcommOptions::validate.
int64_t intField(const py::handle& value, const char* name) {
  if (PyBool_Check(value.ptr()) || !PyLong_Check(value.ptr())) {
    throw py::type_error(std::string("xcomm.Options: ") + name + " must be an int, got " +
                         typeName(value));
  }
  return value.cast<int64_t>();
}

bool boolField(const py::handle& value, const char* name) {
  if (!PyBool_Check(value.ptr())) {
    throw py::type_error(std::string("xcomm.Options: ") + name + " must be a bool, got " +
                         typeName(value));
  }
  return value.cast<bool>();
}

double numberField(const py::handle& value, const char* name) {
  if (PyBool_Check(value.ptr()) || !(PyLong_Check(value.ptr()) || PyFloat_Check(value.ptr()))) {
    throw py::type_error(std::string("xcomm.Options: ") + name + " must be a number, got " +
                         typeName(value));
  }
  return value.cast<double>();
}

c10::intrusive_ptr<xcomm::XcommOptions> makeOptions(
    const py::object& timeout, const py::object& compression, const py::object& minBytes,
    const py::object& chunkElems, const py::object& shm, const py::object& fusionBytes,
    const py::object& cycleMs, const py::object& checkCollectives, const py::object& carrySmallOps,
    const py::object& autoMethods, const py::object& autoLink, const py::object& shmHierarchical,
    const py::object& shmSlotBytes, const py::object& shmSmallBytes,
    const py::object& directExchange) {
  auto options = xcomm::XcommOptions::create();
  if (!timeout.is_none()) {
    auto timedelta = py::module_::import("datetime").attr("timedelta");
    if (!py::isinstance(timeout, timedelta)) {
      throw py::type_error("xcomm.Options: timeout must be a datetime.timedelta, got " +
                           typeName(timeout));
    }
    const double seconds = timeout.attr("total_seconds")().cast<double>();
    TORCH_CHECK_VALUE(seconds > 0, "xcomm.Options: timeout must be positive, got ",
                      py::str(timeout).cast<std::string>());
    options->timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
  }
  if (!compression.is_none()) {
    if (!py::isinstance<py::str>(compression)) {
      throw py::type_error("xcomm.Options: compression must be a str or None, got " +
                           typeName(compression));
    }
    const auto name = compression.cast<std::string>();
    // None, not "none", says "no compression" here.
    const auto names = xcomm::compressionNames();
    const bool known = name != "none" && std::find(names.begin(), names.end(), name) != names.end();
    TORCH_CHECK_VALUE(known, "xcomm.Options: compression must be one of None, ",
                      xcomm::compressionChoices(/*quote=*/true, /*withNone=*/false), ", got '",
                      name, "'");
    options->compression.method = xcomm::parseCompression(name);
  }
  options->compression.minBytes = intField(minBytes, "compression_min_bytes");
  options->compression.int8ChunkElems = intField(chunkElems, "int8_chunk_elems");
  if (!PyBool_Check(shm.ptr())) {
    throw py::type_error("xcomm.Options: shm must be a bool, got " + typeName(shm));
  }
  options->shm = shm.cast<bool>();
  if (!PyBool_Check(checkCollectives.ptr())) {
    throw py::type_error("xcomm.Options: check_collectives must be a bool, got " +
                         typeName(checkCollectives));
  }
  options->checkCollectives = checkCollectives.cast<bool>();
  if (!PyBool_Check(carrySmallOps.ptr())) {
    throw py::type_error("xcomm.Options: carry_small_ops must be a bool, got " +
                         typeName(carrySmallOps));
  }
  options->carrySmallOps = carrySmallOps.cast<bool>();
  options->shmHierarchical = boolField(shmHierarchical, "shm_hierarchical");
  options->directExchange = boolField(directExchange, "direct_exchange");
  // None: the transport's default (-1 inside); a number given must be one.
  if (!shmSlotBytes.is_none()) {
    options->shmSlotBytes = intField(shmSlotBytes, "shm_slot_bytes");
    TORCH_CHECK_VALUE(options->shmSlotBytes > 0,
                      "xcomm.Options: shm_slot_bytes must be > 0 (or None), got ",
                      options->shmSlotBytes);
  }
  if (!shmSmallBytes.is_none()) {
    options->shmSmallBytes = intField(shmSmallBytes, "shm_small_bytes");
    TORCH_CHECK_VALUE(options->shmSmallBytes >= 0,
                      "xcomm.Options: shm_small_bytes must be >= 0 (or None), got ",
                      options->shmSmallBytes);
  }
  options->fusionThresholdBytes = intField(fusionBytes, "fusion_threshold_bytes");
  options->fusionCycleMs = numberField(cycleMs, "fusion_cycle_ms");
  if (!autoMethods.is_none()) {
    if (py::isinstance<py::str>(autoMethods) || !py::isinstance<py::sequence>(autoMethods)) {
      throw py::type_error("xcomm.Options: auto_methods must be a sequence of str or None, got " +
                           typeName(autoMethods));
    }
    std::vector<std::string> names;
    for (const auto& item : autoMethods) {
      if (!py::isinstance<py::str>(item)) {
        throw py::type_error("xcomm.Options: auto_methods must hold str, got " + typeName(item));
      }
      names.push_back(item.cast<std::string>());
    }
    options->compression.autoMethods =
        xcomm::AutoCompression::methodsNamed(names, "xcomm.Options: auto_methods");
  }
  if (!autoLink.is_none()) {
    const bool pair = py::isinstance<py::sequence>(autoLink) &&
                      !py::isinstance<py::str>(autoLink) && py::len(autoLink) == 2;
    if (!pair) {
      throw py::type_error(
          "xcomm.Options: auto_link must be (latency seconds, bytes per second) or None, got " +
          typeName(autoLink));
    }
    const auto link = autoLink.cast<py::sequence>();
    options->compression.autoLinkLatency = numberField(link[0], "auto_link[0] (latency seconds)");
    options->compression.autoLinkBytesPerSecond =
        numberField(link[1], "auto_link[1] (bytes per second)");
    TORCH_CHECK_VALUE(options->compression.autoLinkBytesPerSecond > 0,
                      "xcomm.Options: auto_link's bandwidth must be > 0 bytes per second, got ",
                      options->compression.autoLinkBytesPerSecond);
  }
  options->validate();
  return options;
}

py::dict planDict(const xcomm::GroupPlan& plan) {
  py::dict d;
  d["shape"] = xcomm::groupShapeName(plan.shape);
  d["why"] = plan.why;
  d["rank"] = plan.rank;
  d["size"] = plan.size;
  d["hosts"] = plan.hosts;
  d["host"] = plan.host;
  d["local_rank"] = plan.localRank;
  d["local_size"] = plan.localSize;
  d["backend_compression"] = xcomm::compressionName(plan.backendCompression.method);
  d["leader_compression"] = xcomm::compressionName(plan.leaderCompression.method);
  d["fusion_threshold_bytes"] = plan.fusionThresholdBytes;
  d["fusion_cycle_ms"] = plan.fusionCycle.count() / 1000.0;
  d["checks_collectives"] = plan.checksCollectives();
  d["carry_bytes"] = plan.carryBytes();
  d["checks_leaders"] = plan.checksLeaders();
  d["leader_carry_bytes"] = plan.leaderCarryBytes();
  // The settings, as every rank agreed on them (Options, with the
  // environment's overrides).
  py::dict settings;
  const auto& env = plan.settings;
  settings["shm"] = env.shm;
  settings["shm_hierarchical"] = env.shmHierarchical;
  settings["shm_slot_bytes"] =
      env.shmSlotBytes >= 0 ? py::object(py::int_(env.shmSlotBytes)) : py::object(py::none());
  settings["shm_small_bytes"] =
      env.shmSmallBytes >= 0 ? py::object(py::int_(env.shmSmallBytes)) : py::object(py::none());
  // This rank's own: the one setting the ranks need not share.
  settings["shm_spin_us"] =
      env.shmSpinMicros >= 0 ? py::object(py::int_(env.shmSpinMicros)) : py::object(py::none());
  settings["direct_exchange"] = env.directExchange;
  py::list methods;
  for (auto m : env.autoMethods) methods.append(xcomm::compressionName(m));
  settings["auto_methods"] = methods;
  settings["auto_link"] =
      env.autoLinkBytesPerSecond > 0
          ? py::object(py::make_tuple(env.autoLinkLatency, env.autoLinkBytesPerSecond))
          : py::object(py::none());
  d["settings"] = settings;
  py::list groups;
  for (const auto& g : plan.auxGroups()) {
    py::dict entry;
    entry["name"] = g.name;
    entry["why"] = g.why;
    entry["member"] = g.member;
    entry["rank"] = g.rank;
    entry["size"] = g.size;
    groups.append(entry);
  }
  d["groups"] = groups;
  d["description"] = plan.describe();
  return d;
}

using Factory = std::function<c10::intrusive_ptr<c10d::Backend>(
    const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds)>;

// A Python factory a group keeps for building its successors (shrink): it
// may be dropped on any thread, and after the interpreter finalised (a group
// never destroyed), when taking the GIL to release it would crash. Then it
// is left to the process's exit. The backends it makes (Gloo, NCCL) become
// the group's inner routes as they are.
xcomm::InnerBackendFactory::Make keptByGroup(Factory python) {
  std::shared_ptr<Factory> held(new Factory(std::move(python)), [](Factory* f) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete f;
    }
  });
  return [held](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                std::chrono::milliseconds timeout) -> std::shared_ptr<xcomm::InnerRoute> {
    auto backend = (*held)(store, rank, size, timeout);
    if (!backend) return {};
    return std::make_shared<xcomm::RawRoute>(std::move(backend));
  };
}

void bindGroup(py::module_& m) {
  const xcomm::XcommOptions defaults;
  py::class_<xcomm::XcommOptions, c10::intrusive_ptr<xcomm::XcommOptions>>(m, "XcommOptions")
      .def(py::init(&makeOptions), py::arg("timeout") = py::none(),
           py::arg("compression") = py::none(),
           py::arg("compression_min_bytes") = defaults.compression.minBytes,
           py::arg("int8_chunk_elems") = defaults.compression.int8ChunkElems,
           py::arg("shm") = defaults.shm,
           py::arg("fusion_threshold_bytes") = defaults.fusionThresholdBytes,
           py::arg("fusion_cycle_ms") = defaults.fusionCycleMs,
           py::arg("check_collectives") = defaults.checkCollectives,
           py::arg("carry_small_ops") = defaults.carrySmallOps,
           py::arg("auto_methods") = py::none(), py::arg("auto_link") = py::none(),
           py::arg("shm_hierarchical") = defaults.shmHierarchical,
           py::arg("shm_slot_bytes") = py::none(), py::arg("shm_small_bytes") = py::none(),
           py::arg("direct_exchange") = defaults.directExchange,
           "The C++ options of a group, checked (TypeError/ValueError naming the option). "
           "Users pass xcomm.Options, which converts to this.")
      .def_property_readonly("timeout", [](const xcomm::XcommOptions& o) { return o.timeout; })
      .def_property_readonly("compression",
                             [](const xcomm::XcommOptions& o) {
                               return std::string(xcomm::compressionName(o.compression.method));
                             })
      .def_property_readonly("compression_min_bytes",
                             [](const xcomm::XcommOptions& o) { return o.compression.minBytes; })
      .def_property_readonly(
          "int8_chunk_elems",
          [](const xcomm::XcommOptions& o) { return o.compression.int8ChunkElems; })
      .def_readonly("shm", &xcomm::XcommOptions::shm)
      .def_readonly("fusion_threshold_bytes", &xcomm::XcommOptions::fusionThresholdBytes)
      .def_readonly("fusion_cycle_ms", &xcomm::XcommOptions::fusionCycleMs)
      .def_readonly("check_collectives", &xcomm::XcommOptions::checkCollectives)
      .def_readonly("carry_small_ops", &xcomm::XcommOptions::carrySmallOps)
      .def_readonly("shm_hierarchical", &xcomm::XcommOptions::shmHierarchical)
      .def_readonly("direct_exchange", &xcomm::XcommOptions::directExchange)
      .def_property_readonly("shm_slot_bytes",
                             [](const xcomm::XcommOptions& o) -> py::object {
                               if (o.shmSlotBytes < 0) return py::none();
                               return py::int_(o.shmSlotBytes);
                             })
      .def_property_readonly("shm_small_bytes",
                             [](const xcomm::XcommOptions& o) -> py::object {
                               if (o.shmSmallBytes < 0) return py::none();
                               return py::int_(o.shmSmallBytes);
                             })
      .def_property_readonly("auto_methods",
                             [](const xcomm::XcommOptions& o) -> py::object {
                               if (o.compression.autoMethods.empty()) return py::none();
                               py::list names;
                               for (auto m : o.compression.autoMethods) {
                                 names.append(xcomm::compressionName(m));
                               }
                               return py::tuple(names);
                             })
      .def_property_readonly("auto_link", [](const xcomm::XcommOptions& o) -> py::object {
        if (o.compression.autoLinkBytesPerSecond <= 0) return py::none();
        return py::make_tuple(o.compression.autoLinkLatency, o.compression.autoLinkBytesPerSecond);
      });

  m.def(
      "build_group",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         const c10::intrusive_ptr<xcomm::XcommOptions>& options, Factory cpu,
         std::optional<Factory> cuda, bool awaitReconfigure) {
        xcomm::InnerBackendFactory factory;
        factory.cpu = keptByGroup(std::move(cpu));
        if (cuda) factory.cuda = keptByGroup(std::move(*cuda));
        // Each rank's options object is its own: the group keeps this copy.
        auto own = c10::make_intrusive<xcomm::XcommOptions>(*options);
        // Waits on the store for the other ranks: let other threads run (the
        // factories take the GIL back when they are called).
        py::gil_scoped_release noGil;
        if (awaitReconfigure) {
          return xcomm::buildAwaitingReconfigure(store, rank, size, std::move(own), factory);
        }
        return xcomm::buildGroup(store, rank, size, std::move(own), factory);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"),
      py::arg("cpu_backend"), py::arg("cuda_backend") = py::none(),
      py::arg("await_reconfigure") = false,
      R"(Builds one group (collective over ``store``): decides its GroupPlan from
every member's host identity and ``options``, then calls
``cpu_backend(store, rank, size, timeout)`` for each CPU backend the plan
names (a ProcessGroupGloo) and ``cuda_backend(...)`` once (a
ProcessGroupNCCL, or None). ``await_reconfigure``: torch 2.14's
``enable_reconfigure=True``: nothing is built (nor exchanged) until the
group's first reconfigure().)");

  // The class is bound in Module.cpp; its plan is bound here, beside the plan's dict.
  py::reinterpret_borrow<py::class_<xcomm::XcommBackend, c10d::Backend,
                                    xcomm::python::NoGilHolder<xcomm::XcommBackend>>>(
      m.attr("XcommBackend"))
      .def_property_readonly(
          "plan", [](const xcomm::XcommBackend& b) { return planDict(b.plan()); },
          "What this group is (its GroupPlan): shape and why, hosts, who compresses what, "
          "fusion, and each auxiliary group with the reason it exists.");

  m.def(
      "methods",
      [] {
        std::vector<py::dict> rows;
        for (const auto& method : xcomm::kMethodTable) {
          py::dict row;
          row["name"] = method.name;
          row["lossless"] = method.lossless;
          row["in_default"] = method.inDefault;
          row["host_only"] = method.hostOnly;
          py::list surfaces;
          for (const auto& [bit, name] :
               {std::pair{xcomm::kDdpSurface, "ddp"}, std::pair{xcomm::kFsdpSurface, "fsdp"},
                std::pair{xcomm::kDilocoSurface, "diloco"},
                std::pair{xcomm::kBackendSurface, "backend"}}) {
            if (method.surfaces & bit) surfaces.append(name);
          }
          row["surfaces"] = surfaces;
          rows.push_back(std::move(row));
        }
        return rows;
      },
      "Every compression method (common/Methods.hpp), cheapest codec first: name, lossless, "
      "in_default, host_only and surfaces (where it runs: ddp, fsdp, diloco, backend).");
  m.def(
      "compression_names", [] { return xcomm::compressionNames(); },
      "The backend's compression methods by name, then \"auto\" (Options(compression=) takes "
      "them, None for \"none\"), in the method table's order.");

  // The cost model (collectives/compressed/CostModel): every auto's.
  const auto linkModel = [](const char* what, double latencySeconds, double bytesPerSecond) {
    TORCH_CHECK_VALUE(bytesPerSecond > 0, "xcomm: the ", what,
                      " link's bandwidth must be > 0 bytes per second, got ", bytesPerSecond);
    return xcomm::LinkModel{latencySeconds, bytesPerSecond};
  };
  const auto asPair = [](const xcomm::ReductionCost& c) {
    return std::make_pair(c.codecSeconds, c.wireSeconds);
  };
  m.def("allreduce_cost_keys", &xcomm::allreduceCostKeys, py::arg("methods"),
        "The keys calibrate_allreduce_codecs gives for `methods`, in their order: none has "
        "none, powersgd two (powersgd_mnr, powersgd_pass), every other method its name.");
  m.def("choose_method", &xcomm::chooseMethod, py::arg("seconds"), py::arg("current"),
        py::arg("switch_margin"), py::arg("none_index"),
        "auto's one rule (csrc/collectives/compressed/MethodChoice): the index of the method to "
        "run, of each candidate's predicted `seconds` in the table's order. The least, ties to "
        "the earlier; `current` (-1: none) is kept unless another is `switch_margin` faster, "
        "but never while predicted slower than the uncompressed method at `none_index` "
        "(-1: not a candidate).");
  m.def(
      "predict_allreduce",
      [linkModel, asPair](const std::string& method, int64_t numel, int64_t elementSize, int world,
                          double latencySeconds, double bytesPerSecond,
                          const xcomm::CodecCosts& costs, int64_t int8ChunkElems,
                          double topkDensity, int64_t powersgdP, int64_t powersgdQ,
                          double powersgdMultiplyAdds) {
        xcomm::BucketShape b;
        b.numel = numel;
        b.elementSize = elementSize;
        b.world = world;
        b.int8ChunkElems = int8ChunkElems;
        b.topkDensity = topkDensity;
        b.powersgdP = powersgdP;
        b.powersgdQ = powersgdQ;
        b.powersgdMultiplyAdds = powersgdMultiplyAdds;
        return asPair(xcomm::predictAllreduce(
            method, b, linkModel("allreduce", latencySeconds, bytesPerSecond), costs));
      },
      py::arg("method"), py::arg("numel"), py::arg("element_size"), py::arg("world"),
      py::arg("latency_s"), py::arg("bandwidth_bytes_per_s"), py::arg("costs"), py::kw_only(),
      py::arg("int8_chunk_elems") = xcomm::kDefaultInt8ChunkElems, py::arg("topk_density") = 0.01,
      py::arg("powersgd_p") = 0, py::arg("powersgd_q") = 0, py::arg("powersgd_multiply_adds") = 0.0,
      "auto's cost model of one allreduce (csrc/collectives/compressed/CostModel): "
      "(codec seconds, link seconds) of `method` ('none', 'bf16', 'fp16', 'int8', 'topk', "
      "'powersgd') on a bucket of `numel` elements, `costs` the codecs' calibrated seconds "
      "per element by name. The backend's auto and the DDP hook's share it.");
  m.def(
      "predict_reduce_scatter",
      [linkModel, asPair](const std::string& method, int64_t numel, int64_t elementSize,
                          double reduceScatterLatency, double reduceScatterBytesPerSecond,
                          double allToAllLatency, double allToAllBytesPerSecond,
                          const xcomm::CodecCosts& costs, int64_t int8ChunkElems) {
        xcomm::BucketShape b;
        b.numel = numel;
        b.elementSize = elementSize;
        b.int8ChunkElems = int8ChunkElems;
        return asPair(xcomm::predictReduceScatter(
            method, b,
            linkModel("reduce-scatter", reduceScatterLatency, reduceScatterBytesPerSecond),
            linkModel("all-to-all", allToAllLatency, allToAllBytesPerSecond), costs));
      },
      py::arg("method"), py::arg("numel"), py::arg("element_size"),
      py::arg("reduce_scatter_latency_s"), py::arg("reduce_scatter_bytes_per_s"),
      py::arg("all_to_all_latency_s"), py::arg("all_to_all_bytes_per_s"), py::arg("costs"),
      py::kw_only(), py::arg("int8_chunk_elems") = xcomm::kDefaultInt8ChunkElems,
      "auto's cost model of one reduce-scatter (csrc/collectives/compressed/CostModel): "
      "(codec seconds, link seconds) of `method` ('none', 'bf16', 'fp16', 'int8'); the links "
      "in bytes of input per second. FSDP2's auto predicts with it.");

  // The codec calibration (collectives/compressed/CodecCalibration): every auto's.
  m.def("calibrate_allreduce_codecs", &xcomm::calibrateAllreduceCodecs, py::arg("sample"),
        py::arg("world"), py::arg("int8_chunk_elems"), py::arg("powersgd_rank"), py::arg("methods"),
        py::arg("error_feedback") = true, py::call_guard<py::gil_scoped_release>(),
        "Each codec's seconds per element on this machine for one allreduce of `sample` "
        "(flat float32, on its device): encode (with error feedback unless told not to), decode "
        "and sum `world` "
        "copies, best of 3. Keys as the cost model's (PowerSGD's as powersgd_mnr and "
        "powersgd_pass).");
  m.def("calibrate_reduce_scatter_codecs", &xcomm::calibrateReduceScatterCodecs, py::arg("sample"),
        py::arg("world"), py::arg("int8_chunk_elems"), py::call_guard<py::gil_scoped_release>(),
        "bf16's, fp16's and int8's seconds per element for one reduce-scatter of `sample` "
        "(FSDP2's rows), best of 3.");

  py::class_<xcomm::ObservedFactors>(
      m, "ObservedFactors",
      "auto's closed loop (csrc/collectives/compressed/ObservedFactors): observed/predicted "
      "factors per key, key 0 the link and 1.. the compressed methods. Every auto uses it: "
      "the backend's, and the hooks' through xcomm.hooks._measure.ObservedCosts.")
      .def(py::init<size_t>(), py::arg("keys"))
      .def_readonly_static("FLOOR", &xcomm::ObservedFactors::kFloor)
      .def_readonly_static("CEILING", &xcomm::ObservedFactors::kCeiling)
      .def_readonly_static("RELEARN", &xcomm::ObservedFactors::kRelearn)
      .def_property_readonly("keys", &xcomm::ObservedFactors::keys)
      .def("record", &xcomm::ObservedFactors::record, py::arg("key"), py::arg("observed_s"),
           py::arg("predicted_s"))
      .def("local", &xcomm::ObservedFactors::local,
           "This rank's ratios since the last update (0: not seen).")
      .def("update", &xcomm::ObservedFactors::update, py::arg("agreed"),
           "Folds the agreed ratios into the factors; starts a new period.")
      .def("set_link", &xcomm::ObservedFactors::setLink, py::arg("seconds_per_byte"),
           "The agreed link reading the predictions use from now on (after update()); "
           "returns whether it dropped the link's factor (a reading over 2x off the one "
           "the factor was seen against, none not seen since the last update; with none "
           "seen, the factor is rescaled to the new reading).")
      .def_property_readonly("link_seen_at", &xcomm::ObservedFactors::linkSeenAt)
      .def("restore_link_seen_at", &xcomm::ObservedFactors::restoreLinkSeenAt,
           py::arg("seconds_per_byte"))
      .def(
          "source",
          [](const xcomm::ObservedFactors& o, size_t key) {
            const int from = o.source(key);
            return from < 0 ? py::object(py::none()) : py::object(py::int_(from));
          },
          py::arg("key"), "The key whose factor `key` is predicted with, or None.")
      .def("factor", &xcomm::ObservedFactors::factor, py::arg("key"))
      .def("predict", &xcomm::ObservedFactors::predict, py::arg("key"), py::arg("codec_s"),
           py::arg("wire_s"))
      .def("base", &xcomm::ObservedFactors::base, py::arg("key"), py::arg("codec_s"),
           py::arg("wire_s"))
      .def("stored", &xcomm::ObservedFactors::stored, py::arg("key"))
      .def("seen", &xcomm::ObservedFactors::seen, py::arg("key"))
      .def("restore", &xcomm::ObservedFactors::restore, py::arg("key"), py::arg("factor"),
           py::arg("seen"));

  py::class_<xcomm::LinkEstimate>(
      m, "LinkEstimate",
      "auto's link measurement (csrc/collectives/compressed/LinkEstimate): the readings, "
      "latency, probe sizing, round spacing and confirmations of every auto; the caller runs "
      "the probes and the agreement. The hooks use it through "
      "xcomm.hooks._measure.MeasuredLink.")
      .def(py::init<size_t, double, int64_t>(), py::arg("kinds"), py::arg("probe_fraction"),
           py::arg("interval"))
      .def_readonly_static("MIN_PROBE_BYTES", &xcomm::LinkEstimate::kMinProbeBytes)
      .def_readonly_static("CHANGE_FACTOR", &xcomm::LinkEstimate::kChangeFactor)
      .def_readonly_static("MAX_CONFIRMATIONS", &xcomm::LinkEstimate::kMaxConfirmations)
      .def_property_readonly("interval", &xcomm::LinkEstimate::interval)
      .def_property_readonly("probe_fraction", &xcomm::LinkEstimate::probeFraction)
      .def_property("probe_bytes", &xcomm::LinkEstimate::probeBytes,
                    &xcomm::LinkEstimate::setProbeBytes)
      .def_property_readonly("latency", &xcomm::LinkEstimate::latency)
      .def_property_readonly("last_agreement", &xcomm::LinkEstimate::lastAgreement)
      .def_property(
          "agreements",
          [](const xcomm::LinkEstimate& e) {
            return std::vector<double>(e.agreements().begin(), e.agreements().end());
          },
          &xcomm::LinkEstimate::setAgreements)
      .def_property_readonly("round_overheads",
                             [](const xcomm::LinkEstimate& e) {
                               return std::vector<double>(e.roundOverheads().begin(),
                                                          e.roundOverheads().end());
                             })
      .def_property_readonly("changed", &xcomm::LinkEstimate::changed)
      .def("seconds_per_byte", &xcomm::LinkEstimate::secondsPerByte, py::arg("took_s"),
           py::arg("wire_bytes"))
      .def("agreement_took", &xcomm::LinkEstimate::agreementTook, py::arg("seconds"))
      .def("fold", &xcomm::LinkEstimate::fold, py::arg("latency_s"), py::arg("step_s"),
           py::arg("round_s"), py::arg("newest"),
           "Folds one round's agreed values in; each kind's seconds per byte to predict with.")
      .def("stride", &xcomm::LinkEstimate::stride, py::arg("confirm"),
           "Steps from this round to the next.");

  m.def("host_identity", &xcomm::hostIdentity,
        "This process's host identity: equal strings mean shared memory works between two "
        "processes.");
}

}  // namespace

XCOMM_REGISTER_BINDINGS(group, bindGroup);
