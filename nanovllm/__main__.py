import sys

from nanovllm.cli import main
from nanovllm.program import quiet_ctrl_c

quiet_ctrl_c()
sys.exit(main())
