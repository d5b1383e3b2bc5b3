"""Where a measurement ran, in words for tables and figure titles."""
import os
import platform

import torch

__all__ = ['describe_machine']


def describe_machine(device: torch.device) -> str:
    """'NVIDIA H200' for a CUDA device; 'AMD EPYC, 2 CPUs' (the CPU model, else the architecture) otherwise."""
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    processor = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            processor = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')),
                             processor)
    except OSError:
        pass
    return f"{processor}, {os.cpu_count()} CPUs"
