// Stands in for the CUDA header of the same name under the CPU emulation (see cpu_emulation.h).
#pragma once
#include "cpu_emulation.h"
