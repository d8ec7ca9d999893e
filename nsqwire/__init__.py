"""The NSQ wire protocol, sans-I/O: message ids, names, the command parser, frame
encoders and every E_* error. Ground level: it imports nothing of ours."""
