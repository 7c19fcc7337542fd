// Drives `apprentice acp` with the official ACP TypeScript SDK's ClientSideConnection (1.x line)
// and prints what it saw as one JSON object; tests/plugins/test_acp_node.py asserts on it.
// Usage: node drive_v1.mjs SCENARIO WORKSPACE -- COMMAND ARGS...   (SCENARIO: edit | model)
import { spawn } from "node:child_process";
import { readFileSync, writeFileSync } from "node:fs";
import { Readable, Writable } from "node:stream";
import * as acp from "acp-sdk-1";

const [scenario, workspace, dashdash, ...command] = process.argv.slice(2);
if (dashdash !== "--" || command.length === 0) throw new Error("usage: SCENARIO WORKSPACE -- COMMAND...");

const agentProcess = spawn(command[0], command.slice(1), { stdio: ["pipe", "pipe", "inherit"] });
const report = { updates: {}, permissions: [], reads: [], writes: [] };
let phase = "setup";
let permissionAnswer = "allow_once";   // or "cancel": cancel the turn, then answer cancelled
let connection;

class TestClient {
  async requestPermission(params) {
    report.permissions.push({ phase, toolCall: params.toolCall, options: params.options });
    if (permissionAnswer === "cancel") {
      await connection.cancel({ sessionId: params.sessionId });
      return { outcome: { outcome: "cancelled" } };
    }
    const option = params.options.find((o) => o.kind === permissionAnswer);
    return { outcome: { outcome: "selected", optionId: option.optionId } };
  }
  async sessionUpdate(params) {
    (report.updates[phase] ??= []).push(params.update);
  }
  async readTextFile(params) {
    report.reads.push(params.path);
    return { content: readFileSync(params.path, "utf8") };
  }
  async writeTextFile(params) {
    report.writes.push(params.path);
    writeFileSync(params.path, params.content);
    return {};
  }
}

const stream = acp.ndJsonStream(Writable.toWeb(agentProcess.stdin), Readable.toWeb(agentProcess.stdout));
connection = new acp.ClientSideConnection(() => new TestClient(), stream);

async function main() {
  report.initialize = await connection.initialize({
    protocolVersion: acp.PROTOCOL_VERSION,
    clientCapabilities: { fs: { readTextFile: true, writeTextFile: true } },
  });
  const session = await connection.newSession({ cwd: workspace, mcpServers: [] });
  report.newSession = session;
  const sessionId = session.sessionId;

  phase = "prompt";
  report.prompt = await connection.prompt({ sessionId, prompt: [{ type: "text", text: "Fix add in calc.py" }] });
  if (scenario === "model") return;

  phase = "load";
  report.load = await connection.loadSession({ sessionId, cwd: workspace, mcpServers: [] });

  phase = "cancel";
  permissionAnswer = "cancel";
  report.cancel = await connection.prompt({ sessionId, prompt: [{ type: "text", text: "Now run the tests" }] });

  phase = "unknown";
  try {
    await connection.prompt({ sessionId: "no-such-session", prompt: [{ type: "text", text: "hi" }] });
    report.unknownSession = { error: null };
  } catch (error) {
    report.unknownSession = { error: { code: error.code, message: error.message } };
  }
}

main()
  .then(() => { process.stdout.write(JSON.stringify(report)); })
  .catch((error) => { report.error = String(error?.stack ?? JSON.stringify(error)); process.stdout.write(JSON.stringify(report)); process.exitCode = 1; })
  .finally(() => { agentProcess.stdin.end(); setTimeout(() => agentProcess.kill(), 2000).unref(); });
