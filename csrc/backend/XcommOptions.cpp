#include "backend/XcommOptions.hpp"

#include <cmath>

#include <c10/util/Exception.h>

namespace xcomm {

void XcommOptions::validate() const {
  TORCH_CHECK_VALUE(timeout.count() > 0, "xcomm.Options: timeout must be positive, got ",
                    timeout.count(), " ms");
  TORCH_CHECK_VALUE(compression.minBytes >= 0,
                    "xcomm.Options: compression_min_bytes must be >= 0, got ",
                    compression.minBytes);
  TORCH_CHECK_VALUE(compression.int8ChunkElems > 0,
                    "xcomm.Options: int8_chunk_elems must be > 0, got ",
                    compression.int8ChunkElems);
  const bool isAuto = compression.method == Compression::kAuto;
  TORCH_CHECK_VALUE(compression.autoMethods.empty() || isAuto,
                    "xcomm.Options: auto_methods needs compression='auto'");
  const double latency = compression.autoLinkLatency;
  const double bandwidth = compression.autoLinkBytesPerSecond;
  TORCH_CHECK_VALUE(bandwidth == 0 || isAuto, "xcomm.Options: auto_link needs compression='auto'");
  TORCH_CHECK_VALUE(bandwidth == 0 || (std::isfinite(latency) && latency >= 0 &&
                                       std::isfinite(bandwidth) && bandwidth > 0),
                    "xcomm.Options: auto_link must be (latency seconds >= 0, bytes per second > "
                    "0), got (",
                    latency, ", ", bandwidth, ")");
  TORCH_CHECK_VALUE(shmSlotBytes == -1 || shmSlotBytes > 0,
                    "xcomm.Options: shm_slot_bytes must be > 0 (or None), got ", shmSlotBytes);
  TORCH_CHECK_VALUE(shmSmallBytes >= -1,
                    "xcomm.Options: shm_small_bytes must be >= 0 (or None), got ", shmSmallBytes);
  TORCH_CHECK_VALUE(fusionThresholdBytes >= 0,
                    "xcomm.Options: fusion_threshold_bytes must be >= 0, got ",
                    fusionThresholdBytes);
  TORCH_CHECK_VALUE(fusionCycleMs >= 0 && std::isfinite(fusionCycleMs),
                    "xcomm.Options: fusion_cycle_ms must be >= 0 and finite, got ", fusionCycleMs);
  TORCH_CHECK_VALUE(fusionCycleMs == 0 || fusionThresholdBytes > 0,
                    "xcomm.Options: fusion_cycle_ms needs fusion on: set fusion_threshold_bytes > "
                    "0 too");
}

}  // namespace xcomm
