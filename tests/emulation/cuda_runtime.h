// Stands in for the CUDA runtime header when a kernel source is compiled as host C++ for the
// CPU emulation (CAPMOE_CPU_EMULATION; see cpu_emulation.h).
#pragma once
#include "cpu_emulation.h"
