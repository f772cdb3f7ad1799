#!/usr/bin/env python3
"""Submit one request to an mlarun coordinator and print its tokens as they arrive.

    submit.py [--tls-ca PEM] [--auth-token-file FILE] ADDRESS MAX_TOKENS PROMPT_ID [PROMPT_ID ...]
    submit.py 127.0.0.1:50051 8 3 4 5

--tls-ca: connect over TLS, trusting the CA that signed the coordinator's
certificate (its --tls-cert). --auth-token-file: send the token in the file as
`authorization: Bearer TOKEN` (a line of the coordinator's --auth-token-file).

Needs the stubs generated from serving/proto/mlarun.proto (mlarun_pb2.py and
mlarun_pb2_grpc.py) on the Python path; see README.md.
"""
import sys

import grpc

import mlarun_pb2
import mlarun_pb2_grpc


def main(argv):
    args = argv[1:]
    tls_ca = token = None
    while args and args[0].startswith("--"):
        if len(args) < 2 or args[0] not in ("--tls-ca", "--auth-token-file"):
            print(__doc__.strip(), file=sys.stderr)
            return 2
        with open(args[1], "rb") as f:
            if args[0] == "--tls-ca":
                tls_ca = f.read()
            else:
                token = f.read().decode("ascii").strip()
        args = args[2:]
    if len(args) < 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    address, max_tokens, prompt_ids = args[0], int(args[1]), [int(t) for t in args[2:]]
    metadata = [("authorization", f"Bearer {token}")] if token else None

    channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_ca))
               if tls_ca else grpc.insecure_channel(address))
    with channel:
        stub = mlarun_pb2_grpc.MlarunStub(channel)

        request = mlarun_pb2.GenerateRequest(
            prompt_ids=prompt_ids,
            sampling=mlarun_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=1),
        )
        try:
            # A server-streaming call: one response per token, then one with
            # `finished`. The timeout is the call's deadline (queueing included).
            for response in stub.Generate(request, timeout=30, metadata=metadata):
                if response.HasField("token"):
                    t = response.token
                    print(f"token {t.index}: {t.token_id} (logprob {t.logprob:.3f})", flush=True)
                elif response.HasField("finished"):
                    f = response.finished
                    print(f"finish_reason: {f.finish_reason}")
                    print(f"dp_group: {f.dp_group}")
                    print(f"prefix_hit_tokens: {f.prefix_hit_tokens}")
        except grpc.RpcError as e:
            print(f"Generate failed: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1

        stats = stub.GetStats(mlarun_pb2.GetStatsRequest(), timeout=10, metadata=metadata)
        connected = sum(1 for g in stats.groups if g.connected)
        print(f"groups connected: {connected}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
